from specdec.v1 import model_server_pb2 as _model_server_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("cursor", "draft_tokens", "sampling", "draft_token_q", "return_features", "logprobs", "top_logprobs", "prompt_logprobs", "rules", "steps", "end_token_ids")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_Q_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    cursor: _model_server_pb2.SessionCursor
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _model_server_pb2.SamplingParams
    draft_token_q: _containers.RepeatedScalarFieldContainer[float]
    return_features: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    rules: _model_server_pb2.OutputRules
    steps: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cursor: _Optional[_Union[_model_server_pb2.SessionCursor, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_model_server_pb2.SamplingParams, _Mapping]] = ..., draft_token_q: _Optional[_Iterable[float]] = ..., return_features: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., rules: _Optional[_Union[_model_server_pb2.OutputRules, _Mapping]] = ..., steps: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RowLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("argmax_token_ids", "draft_token_probs", "distributions", "length", "compute_seconds", "bonus_token_id", "batch", "rules_seconds", "features", "features_start", "draft_token_logprobs", "top_logprobs", "bonus_token_logprob", "prompt_token_logprobs", "prompt_top_logprobs", "step_token_ids")
    ARGMAX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    RULES_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_START_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    argmax_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_probs: _containers.RepeatedScalarFieldContainer[float]
    distributions: _containers.RepeatedCompositeFieldContainer[_model_server_pb2.SparseDistribution]
    length: int
    compute_seconds: float
    bonus_token_id: int
    batch: _model_server_pb2.BatchInfo
    rules_seconds: float
    features: bytes
    features_start: int
    draft_token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    bonus_token_logprob: float
    prompt_token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    step_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, argmax_token_ids: _Optional[_Iterable[int]] = ..., draft_token_probs: _Optional[_Iterable[float]] = ..., distributions: _Optional[_Iterable[_Union[_model_server_pb2.SparseDistribution, _Mapping]]] = ..., length: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., bonus_token_id: _Optional[int] = ..., batch: _Optional[_Union[_model_server_pb2.BatchInfo, _Mapping]] = ..., rules_seconds: _Optional[float] = ..., features: _Optional[bytes] = ..., features_start: _Optional[int] = ..., draft_token_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ..., bonus_token_logprob: _Optional[float] = ..., prompt_token_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ..., step_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetLogprobsRequest(_message.Message):
    __slots__ = ("session_id", "position", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetLogprobsResponse(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GetFeaturesRequest(_message.Message):
    __slots__ = ("session_id", "expected_length", "start", "end")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_length: int
    start: int
    end: int
    def __init__(self, session_id: _Optional[str] = ..., expected_length: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class FeaturesChunk(_message.Message):
    __slots__ = ("start", "count", "features")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    features: bytes
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ..., features: _Optional[bytes] = ...) -> None: ...
