import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdatePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_PHASE_ALL: _ClassVar[UpdatePhase]
    UPDATE_PHASE_PREPARE: _ClassVar[UpdatePhase]
    UPDATE_PHASE_PAUSE: _ClassVar[UpdatePhase]
    UPDATE_PHASE_COMMIT: _ClassVar[UpdatePhase]
    UPDATE_PHASE_ABORT: _ClassVar[UpdatePhase]
    UPDATE_PHASE_WRITE: _ClassVar[UpdatePhase]

class RankState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_STATE_UNSPECIFIED: _ClassVar[RankState]
    RANK_STATE_PENDING: _ClassVar[RankState]
    RANK_STATE_LOADING: _ClassVar[RankState]
    RANK_STATE_READY: _ClassVar[RankState]
    RANK_STATE_FAILED: _ClassVar[RankState]
    RANK_STATE_RELEASED: _ClassVar[RankState]
UPDATE_PHASE_ALL: UpdatePhase
UPDATE_PHASE_PREPARE: UpdatePhase
UPDATE_PHASE_PAUSE: UpdatePhase
UPDATE_PHASE_COMMIT: UpdatePhase
UPDATE_PHASE_ABORT: UpdatePhase
UPDATE_PHASE_WRITE: UpdatePhase
RANK_STATE_UNSPECIFIED: RankState
RANK_STATE_PENDING: RankState
RANK_STATE_LOADING: RankState
RANK_STATE_READY: RankState
RANK_STATE_FAILED: RankState
RANK_STATE_RELEASED: RankState

class Rank(_message.Message):
    __slots__ = ("role", "global_rank", "tp_rank", "dp_rank", "local_index", "gpu_uuid", "socket_path", "state", "bytes", "pid", "since", "message")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    role: str
    global_rank: int
    tp_rank: int
    dp_rank: int
    local_index: int
    gpu_uuid: str
    socket_path: str
    state: RankState
    bytes: int
    pid: int
    since: _timestamp_pb2.Timestamp
    message: str
    def __init__(self, role: _Optional[str] = ..., global_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., dp_rank: _Optional[int] = ..., local_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., socket_path: _Optional[str] = ..., state: _Optional[_Union[RankState, str]] = ..., bytes: _Optional[int] = ..., pid: _Optional[int] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("cache", "namespace", "node", "node_rank", "node_count", "epoch", "runtime", "ready", "held", "restarts", "ranks", "version", "message", "alignment_misses", "generation", "model_path", "revision", "warmup_cache")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_MISSES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    WARMUP_CACHE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    namespace: str
    node: str
    node_rank: int
    node_count: int
    epoch: int
    runtime: str
    ready: bool
    held: bool
    restarts: int
    ranks: _containers.RepeatedCompositeFieldContainer[Rank]
    version: str
    message: str
    alignment_misses: _containers.RepeatedCompositeFieldContainer[AlignmentMiss]
    generation: int
    model_path: str
    revision: str
    warmup_cache: WarmupCache
    def __init__(self, cache: _Optional[str] = ..., namespace: _Optional[str] = ..., node: _Optional[str] = ..., node_rank: _Optional[int] = ..., node_count: _Optional[int] = ..., epoch: _Optional[int] = ..., runtime: _Optional[str] = ..., ready: _Optional[bool] = ..., held: _Optional[bool] = ..., restarts: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[Rank, _Mapping]]] = ..., version: _Optional[str] = ..., message: _Optional[str] = ..., alignment_misses: _Optional[_Iterable[_Union[AlignmentMiss, _Mapping]]] = ..., generation: _Optional[int] = ..., model_path: _Optional[str] = ..., revision: _Optional[str] = ..., warmup_cache: _Optional[_Union[WarmupCache, _Mapping]] = ...) -> None: ...

class WarmupCache(_message.Message):
    __slots__ = ("path", "identity", "bytes", "bytes_by_kind", "scanned_at", "unsafe", "hits", "misses")
    class BytesByKindEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MissesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_KIND_FIELD_NUMBER: _ClassVar[int]
    SCANNED_AT_FIELD_NUMBER: _ClassVar[int]
    UNSAFE_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    path: str
    identity: str
    bytes: int
    bytes_by_kind: _containers.ScalarMap[str, int]
    scanned_at: _timestamp_pb2.Timestamp
    unsafe: str
    hits: _containers.ScalarMap[str, int]
    misses: _containers.ScalarMap[str, int]
    def __init__(self, path: _Optional[str] = ..., identity: _Optional[str] = ..., bytes: _Optional[int] = ..., bytes_by_kind: _Optional[_Mapping[str, int]] = ..., scanned_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., unsafe: _Optional[str] = ..., hits: _Optional[_Mapping[str, int]] = ..., misses: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AlignmentMiss(_message.Message):
    __slots__ = ("seq", "pod", "result", "detail", "missed_ranks")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MISSED_RANKS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pod: str
    result: str
    detail: str
    missed_ranks: int
    def __init__(self, seq: _Optional[int] = ..., pod: _Optional[str] = ..., result: _Optional[str] = ..., detail: _Optional[str] = ..., missed_ranks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "message")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    released: bool
    message: str
    def __init__(self, released: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class RestartRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class RestartResponse(_message.Message):
    __slots__ = ("accepted", "epoch", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    epoch: int
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., epoch: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("model_path", "revision", "force", "pause_deadline_seconds", "phase")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    revision: str
    force: bool
    pause_deadline_seconds: float
    phase: UpdatePhase
    def __init__(self, model_path: _Optional[str] = ..., revision: _Optional[str] = ..., force: _Optional[bool] = ..., pause_deadline_seconds: _Optional[float] = ..., phase: _Optional[_Union[UpdatePhase, str]] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("ok", "error", "message", "generation", "revision", "bytes", "seconds_staged", "seconds_paused", "engines_paused", "broken", "tensors", "rollback", "rollback_why", "rolled_back")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_STAGED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    ENGINES_PAUSED_FIELD_NUMBER: _ClassVar[int]
    BROKEN_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_WHY_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    message: str
    generation: int
    revision: str
    bytes: int
    seconds_staged: float
    seconds_paused: float
    engines_paused: int
    broken: bool
    tensors: _containers.RepeatedScalarFieldContainer[str]
    rollback: bool
    rollback_why: str
    rolled_back: bool
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., message: _Optional[str] = ..., generation: _Optional[int] = ..., revision: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds_staged: _Optional[float] = ..., seconds_paused: _Optional[float] = ..., engines_paused: _Optional[int] = ..., broken: _Optional[bool] = ..., tensors: _Optional[_Iterable[str]] = ..., rollback: _Optional[bool] = ..., rollback_why: _Optional[str] = ..., rolled_back: _Optional[bool] = ...) -> None: ...
