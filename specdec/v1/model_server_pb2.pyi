from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ...) -> None: ...

class OutputRules(_message.Message):
    __slots__ = ("output_start", "grammar", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_tokens_blocked")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_BLOCKED_FIELD_NUMBER: _ClassVar[int]
    output_start: int
    grammar: Grammar
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    min_tokens_blocked: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_start: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., min_tokens_blocked: _Optional[_Iterable[int]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs", "complete", "candidate_ids", "candidate_probs", "head_ids", "head_probs", "head_floor")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_PROBS_FIELD_NUMBER: _ClassVar[int]
    HEAD_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_PROBS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FLOOR_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    complete: bool
    candidate_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_probs: _containers.RepeatedScalarFieldContainer[float]
    head_ids: _containers.RepeatedScalarFieldContainer[int]
    head_probs: _containers.RepeatedScalarFieldContainer[float]
    head_floor: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., complete: _Optional[bool] = ..., candidate_ids: _Optional[_Iterable[int]] = ..., candidate_probs: _Optional[_Iterable[float]] = ..., head_ids: _Optional[_Iterable[int]] = ..., head_probs: _Optional[_Iterable[float]] = ..., head_floor: _Optional[float] = ...) -> None: ...

class SessionCursor(_message.Message):
    __slots__ = ("session_id", "expected_length", "keep_length", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEEP_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_length: int
    keep_length: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., expected_length: _Optional[int] = ..., keep_length: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchInfo(_message.Message):
    __slots__ = ("queue_seconds", "rows", "sessions", "active_sessions")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    rows: int
    sessions: int
    active_sessions: int
    def __init__(self, queue_seconds: _Optional[float] = ..., rows: _Optional[int] = ..., sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ...) -> None: ...

class TruncateRequest(_message.Message):
    __slots__ = ("session_id", "expected_length", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_length: int
    length: int
    def __init__(self, session_id: _Optional[str] = ..., expected_length: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class TruncateResponse(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetDistributionRequest(_message.Message):
    __slots__ = ("session_id", "position", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetDistributionResponse(_message.Message):
    __slots__ = ("probs", "probs_f32", "token_probs_f32")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PROBS_F32_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_F32_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    probs_f32: bytes
    token_probs_f32: bytes
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., probs_f32: _Optional[bytes] = ..., token_probs_f32: _Optional[bytes] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "max_model_len", "max_sessions", "max_tokens", "max_draft_tokens", "dtype", "device", "forward", "pass_costs", "sessions_in_use", "tokens_in_use", "draining", "feature_size", "feature_fingerprint", "numerics", "reads_features")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    PASS_COSTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    READS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    max_sessions: int
    max_tokens: int
    max_draft_tokens: int
    dtype: str
    device: str
    forward: str
    pass_costs: _containers.RepeatedCompositeFieldContainer[PassCost]
    sessions_in_use: int
    tokens_in_use: int
    draining: bool
    feature_size: int
    feature_fingerprint: str
    numerics: str
    reads_features: bool
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., forward: _Optional[str] = ..., pass_costs: _Optional[_Iterable[_Union[PassCost, _Mapping]]] = ..., sessions_in_use: _Optional[int] = ..., tokens_in_use: _Optional[int] = ..., draining: _Optional[bool] = ..., feature_size: _Optional[int] = ..., feature_fingerprint: _Optional[str] = ..., numerics: _Optional[str] = ..., reads_features: _Optional[bool] = ...) -> None: ...

class PassCost(_message.Message):
    __slots__ = ("rows", "seconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    seconds: float
    def __init__(self, rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
