from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_OK: _ClassVar[StatusCode]
    STATUS_CANCELLED: _ClassVar[StatusCode]
    STATUS_UNKNOWN: _ClassVar[StatusCode]
    STATUS_INVALID_ARGUMENT: _ClassVar[StatusCode]
    STATUS_DEADLINE_EXCEEDED: _ClassVar[StatusCode]
    STATUS_NOT_FOUND: _ClassVar[StatusCode]
    STATUS_ALREADY_EXISTS: _ClassVar[StatusCode]
    STATUS_PERMISSION_DENIED: _ClassVar[StatusCode]
    STATUS_RESOURCE_EXHAUSTED: _ClassVar[StatusCode]
    STATUS_FAILED_PRECONDITION: _ClassVar[StatusCode]
    STATUS_ABORTED: _ClassVar[StatusCode]
    STATUS_OUT_OF_RANGE: _ClassVar[StatusCode]
    STATUS_UNIMPLEMENTED: _ClassVar[StatusCode]
    STATUS_INTERNAL: _ClassVar[StatusCode]
    STATUS_UNAVAILABLE: _ClassVar[StatusCode]
    STATUS_DATA_LOSS: _ClassVar[StatusCode]
    STATUS_UNAUTHENTICATED: _ClassVar[StatusCode]

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    FORWARD: _ClassVar[FrameKind]
    RELEASE: _ClassVar[FrameKind]
    ERROR: _ClassVar[FrameKind]
    PING: _ClassVar[FrameKind]
STATUS_OK: StatusCode
STATUS_CANCELLED: StatusCode
STATUS_UNKNOWN: StatusCode
STATUS_INVALID_ARGUMENT: StatusCode
STATUS_DEADLINE_EXCEEDED: StatusCode
STATUS_NOT_FOUND: StatusCode
STATUS_ALREADY_EXISTS: StatusCode
STATUS_PERMISSION_DENIED: StatusCode
STATUS_RESOURCE_EXHAUSTED: StatusCode
STATUS_FAILED_PRECONDITION: StatusCode
STATUS_ABORTED: StatusCode
STATUS_OUT_OF_RANGE: StatusCode
STATUS_UNIMPLEMENTED: StatusCode
STATUS_INTERNAL: StatusCode
STATUS_UNAVAILABLE: StatusCode
STATUS_DATA_LOSS: StatusCode
STATUS_UNAUTHENTICATED: StatusCode
FRAME_KIND_UNSPECIFIED: FrameKind
FORWARD: FrameKind
RELEASE: FrameKind
ERROR: FrameKind
PING: FrameKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("request_id", "kind", "start_pos", "next_layer", "capacity", "hidden", "error", "seq", "epoch", "code", "batch_rest", "prefix_key", "prefix_len", "save_key", "save_len", "prefill", "window", "live_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    NEXT_LAYER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_REST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SAVE_KEY_FIELD_NUMBER: _ClassVar[int]
    SAVE_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LIVE_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: FrameKind
    start_pos: int
    next_layer: int
    capacity: int
    hidden: Tensor
    error: str
    seq: int
    epoch: int
    code: StatusCode
    batch_rest: int
    prefix_key: str
    prefix_len: int
    save_key: str
    save_len: int
    prefill: bool
    window: int
    live_from: int
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., start_pos: _Optional[int] = ..., next_layer: _Optional[int] = ..., capacity: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ..., seq: _Optional[int] = ..., epoch: _Optional[int] = ..., code: _Optional[_Union[StatusCode, str]] = ..., batch_rest: _Optional[int] = ..., prefix_key: _Optional[str] = ..., prefix_len: _Optional[int] = ..., save_key: _Optional[str] = ..., save_len: _Optional[int] = ..., prefill: _Optional[bool] = ..., window: _Optional[int] = ..., live_from: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("resident_bytes", "disk_read_bytes", "compute_s", "stall_s", "link_s", "last_token_ms", "frames", "active_requests", "rss_bytes", "batches", "batched_frames", "max_batch_seen", "queue_depth", "queue_wait_s", "max_batch", "decode_s", "decode_frames", "prefilled_tokens", "prefix_hit_tokens", "prefix_cached_tokens", "prefix_disk_bytes", "prefix_disk_tokens")
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    LINK_S_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEEN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    resident_bytes: int
    disk_read_bytes: int
    compute_s: float
    stall_s: float
    link_s: float
    last_token_ms: float
    frames: int
    active_requests: int
    rss_bytes: int
    batches: int
    batched_frames: int
    max_batch_seen: int
    queue_depth: int
    queue_wait_s: float
    max_batch: int
    decode_s: float
    decode_frames: int
    prefilled_tokens: int
    prefix_hit_tokens: int
    prefix_cached_tokens: int
    prefix_disk_bytes: int
    prefix_disk_tokens: int
    def __init__(self, resident_bytes: _Optional[int] = ..., disk_read_bytes: _Optional[int] = ..., compute_s: _Optional[float] = ..., stall_s: _Optional[float] = ..., link_s: _Optional[float] = ..., last_token_ms: _Optional[float] = ..., frames: _Optional[int] = ..., active_requests: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., batches: _Optional[int] = ..., batched_frames: _Optional[int] = ..., max_batch_seen: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., max_batch: _Optional[int] = ..., decode_s: _Optional[float] = ..., decode_frames: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ..., prefix_disk_bytes: _Optional[int] = ..., prefix_disk_tokens: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "address", "peer", "role", "windows", "loaded", "n_layers", "model_id", "model_name", "mem_budget", "stats", "node_id", "error", "epoch", "state", "members", "head", "cached_units", "fetched_bytes", "predicted_ms", "predicted_tpot_ms", "compute_dtype", "standby", "head_copy", "ring", "kv_positions", "kv_dtype", "kv_bytes_per_token", "draft", "max_cpu", "max_memory", "nice", "replan", "available_memory", "memory_pressure", "memory_low", "replan_state", "replans")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MEM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    CACHED_UNITS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    HEAD_COPY_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    KV_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_FIELD_NUMBER: _ClassVar[int]
    NICE_FIELD_NUMBER: _ClassVar[int]
    REPLAN_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LOW_FIELD_NUMBER: _ClassVar[int]
    REPLAN_STATE_FIELD_NUMBER: _ClassVar[int]
    REPLANS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    peer: str
    role: str
    windows: _containers.RepeatedCompositeFieldContainer[LayerRange]
    loaded: bool
    n_layers: int
    model_id: str
    model_name: str
    mem_budget: int
    stats: NodeStats
    node_id: str
    error: str
    epoch: int
    state: str
    members: _containers.RepeatedCompositeFieldContainer[Member]
    head: str
    cached_units: int
    fetched_bytes: int
    predicted_ms: float
    predicted_tpot_ms: float
    compute_dtype: str
    standby: bool
    head_copy: bool
    ring: _containers.RepeatedScalarFieldContainer[str]
    kv_positions: int
    kv_dtype: str
    kv_bytes_per_token: int
    draft: bool
    max_cpu: float
    max_memory: int
    nice: bool
    replan: bool
    available_memory: int
    memory_pressure: float
    memory_low: bool
    replan_state: str
    replans: _containers.RepeatedCompositeFieldContainer[Replan]
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., peer: _Optional[str] = ..., role: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., loaded: _Optional[bool] = ..., n_layers: _Optional[int] = ..., model_id: _Optional[str] = ..., model_name: _Optional[str] = ..., mem_budget: _Optional[int] = ..., stats: _Optional[_Union[NodeStats, _Mapping]] = ..., node_id: _Optional[str] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[str] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., head: _Optional[str] = ..., cached_units: _Optional[int] = ..., fetched_bytes: _Optional[int] = ..., predicted_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., compute_dtype: _Optional[str] = ..., standby: _Optional[bool] = ..., head_copy: _Optional[bool] = ..., ring: _Optional[_Iterable[str]] = ..., kv_positions: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., draft: _Optional[bool] = ..., max_cpu: _Optional[float] = ..., max_memory: _Optional[int] = ..., nice: _Optional[bool] = ..., replan: _Optional[bool] = ..., available_memory: _Optional[int] = ..., memory_pressure: _Optional[float] = ..., memory_low: _Optional[bool] = ..., replan_state: _Optional[str] = ..., replans: _Optional[_Iterable[_Union[Replan, _Mapping]]] = ...) -> None: ...

class Replan(_message.Message):
    __slots__ = ("at", "reason", "node", "assumed_ms", "measured_ms", "predicted_gain", "seconds")
    AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    at: float
    reason: str
    node: str
    assumed_ms: float
    measured_ms: float
    predicted_gain: float
    seconds: float
    def __init__(self, at: _Optional[float] = ..., reason: _Optional[str] = ..., node: _Optional[str] = ..., assumed_ms: _Optional[float] = ..., measured_ms: _Optional[float] = ..., predicted_gain: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("address", "state")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("windows", "head", "model_id", "ring_layers", "epoch", "replan", "ring", "stream_buffer_layers", "head_address", "max_batch", "micro_batches", "kv_dtype", "ctx", "predicted_ms", "predicted_tpot_ms", "head_windows", "standby")
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    RING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLAN_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    STREAM_BUFFER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEAD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CTX_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    HEAD_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    windows: _containers.RepeatedCompositeFieldContainer[LayerRange]
    head: bool
    model_id: str
    ring_layers: int
    epoch: int
    replan: bool
    ring: _containers.RepeatedScalarFieldContainer[str]
    stream_buffer_layers: float
    head_address: str
    max_batch: int
    micro_batches: int
    kv_dtype: str
    ctx: int
    predicted_ms: float
    predicted_tpot_ms: float
    head_windows: _containers.RepeatedCompositeFieldContainer[LayerRange]
    standby: bool
    def __init__(self, windows: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., head: _Optional[bool] = ..., model_id: _Optional[str] = ..., ring_layers: _Optional[int] = ..., epoch: _Optional[int] = ..., replan: _Optional[bool] = ..., ring: _Optional[_Iterable[str]] = ..., stream_buffer_layers: _Optional[float] = ..., head_address: _Optional[str] = ..., max_batch: _Optional[int] = ..., micro_batches: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., ctx: _Optional[int] = ..., predicted_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., head_windows: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., standby: _Optional[bool] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("done_bytes", "total_bytes", "unit", "ready", "fetch")
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    done_bytes: int
    total_bytes: int
    unit: str
    ready: bool
    fetch: bool
    def __init__(self, done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., unit: _Optional[str] = ..., ready: _Optional[bool] = ..., fetch: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model_id", "name", "offset")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    offset: int
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data", "total_bytes")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("refresh",)
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    refresh: bool
    def __init__(self, refresh: _Optional[bool] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("json", "manifest")
    JSON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    json: str
    manifest: str
    def __init__(self, json: _Optional[str] = ..., manifest: _Optional[str] = ...) -> None: ...

class SetPeerRequest(_message.Message):
    __slots__ = ("peer", "drain")
    PEER_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    peer: str
    drain: bool
    def __init__(self, peer: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class SetPeerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("ring",)
    RING_FIELD_NUMBER: _ClassVar[int]
    ring: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ring: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("address", "model_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    model_id: str
    def __init__(self, address: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("ring",)
    RING_FIELD_NUMBER: _ClassVar[int]
    ring: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ring: _Optional[_Iterable[str]] = ...) -> None: ...

class TakeOverRequest(_message.Message):
    __slots__ = ("lost", "ring", "forget")
    LOST_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    FORGET_FIELD_NUMBER: _ClassVar[int]
    lost: str
    ring: _containers.RepeatedScalarFieldContainer[str]
    forget: bool
    def __init__(self, lost: _Optional[str] = ..., ring: _Optional[_Iterable[str]] = ..., forget: _Optional[bool] = ...) -> None: ...

class TakeOverReply(_message.Message):
    __slots__ = ("ring",)
    RING_FIELD_NUMBER: _ClassVar[int]
    ring: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ring: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "context", "n", "vocab")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context: _containers.RepeatedScalarFieldContainer[int]
    n: int
    vocab: str
    def __init__(self, request_id: _Optional[str] = ..., context: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., vocab: _Optional[str] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "raw", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "request_id", "speculate", "draft_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "response_format", "json_schema", "tools", "tool_choice", "chat_template_kwargs", "depth", "resume_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    raw: bool
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    speculate: str
    draft_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: bool
    top_logprobs: int
    response_format: str
    json_schema: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    chat_template_kwargs: str
    depth: int
    resume_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., raw: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., speculate: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., response_format: _Optional[str] = ..., json_schema: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., chat_template_kwargs: _Optional[str] = ..., depth: _Optional[int] = ..., resume_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "text", "index", "elapsed_ms", "logprob", "top_logprobs", "token", "tool_calls")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    index: int
    elapsed_ms: float
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "ttft_ms", "tpot_ms", "request_id", "drafted", "accepted", "tool_calls", "max_tokens", "depth", "trips")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TRIPS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    tpot_ms: float
    request_id: str
    drafted: int
    accepted: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    max_tokens: int
    depth: int
    trips: int
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., request_id: _Optional[str] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., depth: _Optional[int] = ..., trips: _Optional[int] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("done", "total")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    done: int
    total: int
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "finished", "prefill")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    token: TokenEvent
    finished: Finished
    prefill: PrefillProgress
    def __init__(self, token: _Optional[_Union[TokenEvent, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., prefill: _Optional[_Union[PrefillProgress, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
