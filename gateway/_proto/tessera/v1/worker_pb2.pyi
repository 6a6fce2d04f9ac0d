# ruff: noqa
from gateway._proto.tessera.v1 import gateway_pb2 as _gateway_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_gateway_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_gateway_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "text", "token_ids", "chat", "sampling", "split_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _gateway_pb2.SamplingOptions
    split_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_gateway_pb2.SamplingOptions, _Mapping]] = ..., split_special_tokens: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "token_ids", "sampling", "first_page", "max_frame_bytes", "shm_ring")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_RING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    token_ids: TokenIds
    sampling: _gateway_pb2.SamplingOptions
    first_page: int
    max_frame_bytes: int
    shm_ring: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_gateway_pb2.SamplingOptions, _Mapping]] = ..., first_page: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., shm_ring: _Optional[str] = ...) -> None: ...

class ShmFrame(_message.Message):
    __slots__ = ("slot", "nbytes")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    nbytes: int
    def __init__(self, slot: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("out", "frame", "shm_frame")
    OUT_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SHM_FRAME_FIELD_NUMBER: _ClassVar[int]
    out: _gateway_pb2.GenerateResponse
    frame: bytes
    shm_frame: ShmFrame
    def __init__(self, out: _Optional[_Union[_gateway_pb2.GenerateResponse, _Mapping]] = ..., frame: _Optional[bytes] = ..., shm_frame: _Optional[_Union[ShmFrame, _Mapping]] = ...) -> None: ...

class ImportGenerateRequest(_message.Message):
    __slots__ = ("request", "prefill_target", "transfer_timeout_s", "max_frame_bytes")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TARGET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    request: WorkerGenerateRequest
    prefill_target: str
    transfer_timeout_s: float
    max_frame_bytes: int
    def __init__(self, request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., prefill_target: _Optional[str] = ..., transfer_timeout_s: _Optional[float] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "worker_id", "pid", "engine_alive", "last_step_age_s", "step_running_s")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_RUNNING_S_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    worker_id: str
    pid: int
    engine_alive: bool
    last_step_age_s: float
    step_running_s: float
    def __init__(self, serving: _Optional[bool] = ..., worker_id: _Optional[str] = ..., pid: _Optional[int] = ..., engine_alive: _Optional[bool] = ..., last_step_age_s: _Optional[float] = ..., step_running_s: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefixCacheSummary(_message.Message):
    __slots__ = ("enabled", "cached_pages", "evictable_pages")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    cached_pages: int
    evictable_pages: int
    def __init__(self, enabled: _Optional[bool] = ..., cached_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("worker_id", "served", "num_pages", "num_free_pages", "page_size", "num_running", "num_waiting", "num_preemptions", "max_model_len", "prefix_cache", "requests_served", "integrity_checks", "integrity_mismatches", "native_ops", "role", "exported", "imported", "num_threads", "times")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_CHECKS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    NATIVE_OPS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    served: _gateway_pb2.ServedConfig
    num_pages: int
    num_free_pages: int
    page_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    max_model_len: int
    prefix_cache: PrefixCacheSummary
    requests_served: int
    integrity_checks: int
    integrity_mismatches: int
    native_ops: str
    role: str
    exported: TransferStats
    imported: TransferStats
    num_threads: int
    times: EngineTimes
    def __init__(self, worker_id: _Optional[str] = ..., served: _Optional[_Union[_gateway_pb2.ServedConfig, _Mapping]] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., max_model_len: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheSummary, _Mapping]] = ..., requests_served: _Optional[int] = ..., integrity_checks: _Optional[int] = ..., integrity_mismatches: _Optional[int] = ..., native_ops: _Optional[str] = ..., role: _Optional[str] = ..., exported: _Optional[_Union[TransferStats, _Mapping]] = ..., imported: _Optional[_Union[TransferStats, _Mapping]] = ..., num_threads: _Optional[int] = ..., times: _Optional[_Union[EngineTimes, _Mapping]] = ...) -> None: ...

class StepTotals(_message.Message):
    __slots__ = ("steps", "wall_s", "compute_s", "decode_rows", "prefill_tokens")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    wall_s: float
    compute_s: float
    decode_rows: int
    prefill_tokens: int
    def __init__(self, steps: _Optional[int] = ..., wall_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., decode_rows: _Optional[int] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class EngineTimes(_message.Message):
    __slots__ = ("decode", "mixed", "commands_s", "publish_s", "idle_s", "loop_cpu_s")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    MIXED_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_S_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    LOOP_CPU_S_FIELD_NUMBER: _ClassVar[int]
    decode: StepTotals
    mixed: StepTotals
    commands_s: float
    publish_s: float
    idle_s: float
    loop_cpu_s: float
    def __init__(self, decode: _Optional[_Union[StepTotals, _Mapping]] = ..., mixed: _Optional[_Union[StepTotals, _Mapping]] = ..., commands_s: _Optional[float] = ..., publish_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., loop_cpu_s: _Optional[float] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("transfers", "frames", "pages", "bytes", "duration_s", "failures", "pending", "waiting", "shm_frames")
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SHM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    transfers: int
    frames: int
    pages: int
    bytes: int
    duration_s: float
    failures: _containers.ScalarMap[str, int]
    pending: int
    waiting: int
    shm_frames: int
    def __init__(self, transfers: _Optional[int] = ..., frames: _Optional[int] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., duration_s: _Optional[float] = ..., failures: _Optional[_Mapping[str, int]] = ..., pending: _Optional[int] = ..., waiting: _Optional[int] = ..., shm_frames: _Optional[int] = ...) -> None: ...
