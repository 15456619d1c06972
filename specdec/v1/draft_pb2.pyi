from specdec.v1 import model_server_pb2 as _model_server_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeTokensRequest(_message.Message):
    __slots__ = ("cursor", "num_tokens", "sampling", "min_confidence", "features", "rules")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    cursor: _model_server_pb2.SessionCursor
    num_tokens: int
    sampling: _model_server_pb2.SamplingParams
    min_confidence: float
    features: bytes
    rules: _model_server_pb2.OutputRules
    def __init__(self, cursor: _Optional[_Union[_model_server_pb2.SessionCursor, _Mapping]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_model_server_pb2.SamplingParams, _Mapping]] = ..., min_confidence: _Optional[float] = ..., features: _Optional[bytes] = ..., rules: _Optional[_Union[_model_server_pb2.OutputRules, _Mapping]] = ...) -> None: ...

class ProposeTokensResponse(_message.Message):
    __slots__ = ("token_ids", "token_probs", "distributions", "length", "compute_seconds", "batch", "rules_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    RULES_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    distributions: _containers.RepeatedCompositeFieldContainer[_model_server_pb2.SparseDistribution]
    length: int
    compute_seconds: float
    batch: _model_server_pb2.BatchInfo
    rules_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_probs: _Optional[_Iterable[float]] = ..., distributions: _Optional[_Iterable[_Union[_model_server_pb2.SparseDistribution, _Mapping]]] = ..., length: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., batch: _Optional[_Union[_model_server_pb2.BatchInfo, _Mapping]] = ..., rules_seconds: _Optional[float] = ...) -> None: ...
