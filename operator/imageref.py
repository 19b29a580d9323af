"""Container image references: one parser for the spec's check and the webhook's comparison.

The grammar is Docker's (distribution/reference `reference.go`): `[DOMAIN/]PATH[:TAG][@DIGEST]`.
Docker's normaliser (`normalize.go`, `splitDockerDomain`) decides what the first component is:
a domain only if it contains `.` or `:` or is `localhost`, otherwise the reference lives on
Docker Hub (`docker.io`, with `library/` before a one-component path), and a reference with
neither tag nor digest means `latest`. The vLLM fingerprint includes the engine's version, so
two spellings of one image must compare equal and two tags must not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?)"
IMAGE_RE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_NAME_COMPONENT}(?:/{_NAME_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)
DEFAULT_DOMAIN = "docker.io"


@dataclass(frozen=True)
class ImageRef:
    """A parsed reference as written (`tag` None when absent) and its normalised repository."""

    domain: str  # explicit, or docker.io
    path: str  # with library/ for a one-component Docker Hub path
    tag: str | None
    digest: str | None

    @property
    def repository(self) -> str:
        return f"{self.domain}/{self.path}"

    @property
    def pins_version(self) -> bool:
        """A digest, or a tag other than the moving `latest`."""
        return bool(self.digest) or self.tag not in (None, "latest")

    def same_image(self, other: ImageRef) -> bool:
        """Equal digests when both have one; else the same repository and tag."""
        if self.digest and other.digest:
            return self.digest == other.digest
        return (self.repository, self.tag or "latest") == (other.repository, other.tag or "latest")


def parse(image: str) -> ImageRef | None:
    """The reference `image`, normalised as Docker does; None if it is not one."""
    match = IMAGE_RE.match(image)
    if match is None:
        return None
    domain, path = match["domain"], match["path"]
    if domain is not None and not ("." in domain or ":" in domain or domain == "localhost"):
        # The regex cannot tell `vllm/vllm-openai` from `registry/x`: Docker's rule can.
        domain, path = None, f"{domain}/{path}"
    if domain is None:
        domain = DEFAULT_DOMAIN
        if "/" not in path:
            path = f"library/{path}"
    return ImageRef(domain=domain, path=path, tag=match["tag"], digest=match["digest"])


def differ(a: str, b: str) -> bool:
    """Whether two references name different images (unparsable ones compare as text)."""
    ra, rb = parse(a), parse(b)
    if ra is None or rb is None:
        return a != b
    return not ra.same_image(rb)
