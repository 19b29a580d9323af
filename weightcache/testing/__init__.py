"""Test and development harnesses: kmock glue, the local webhook server, checkpoint writers,
child-process wrappers, free ports and the helm/kubectl installer.

Imported by `tests/`, `e2e/` and `weightcache.bench`; never by product code (an import
contract checks it), and not shipped in the images. It may import every product package.
"""
