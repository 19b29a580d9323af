import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_STATE_UNSPECIFIED: _ClassVar[RankState]
    RANK_STATE_PENDING: _ClassVar[RankState]
    RANK_STATE_LOADING: _ClassVar[RankState]
    RANK_STATE_READY: _ClassVar[RankState]
    RANK_STATE_FAILED: _ClassVar[RankState]
    RANK_STATE_RELEASED: _ClassVar[RankState]
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
    __slots__ = ("cache", "namespace", "node", "node_rank", "node_count", "epoch", "runtime", "ready", "held", "restarts", "ranks", "version", "message", "alignment_misses")
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
    def __init__(self, cache: _Optional[str] = ..., namespace: _Optional[str] = ..., node: _Optional[str] = ..., node_rank: _Optional[int] = ..., node_count: _Optional[int] = ..., epoch: _Optional[int] = ..., runtime: _Optional[str] = ..., ready: _Optional[bool] = ..., held: _Optional[bool] = ..., restarts: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[Rank, _Mapping]]] = ..., version: _Optional[str] = ..., message: _Optional[str] = ..., alignment_misses: _Optional[_Iterable[_Union[AlignmentMiss, _Mapping]]] = ...) -> None: ...

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
