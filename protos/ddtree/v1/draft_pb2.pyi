from ddtree.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenStepSocketRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepSocketOffer(_message.Message):
    __slots__ = ("name", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: bytes
    def __init__(self, name: _Optional[str] = ..., key: _Optional[bytes] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "mode", "budget", "max_new_tokens", "prompt_continues", "prompt_offset")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    mode: _common_pb2.Mode
    budget: int
    max_new_tokens: int
    prompt_continues: bool
    prompt_offset: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.Mode, str]] = ..., budget: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., prompt_continues: _Optional[bool] = ..., prompt_offset: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("items", "release")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("request_id", "token_ids", "acceptance_length", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    acceptance_length: int
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., acceptance_length: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "draft_ms", "verify_ms", "decoded")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    draft_ms: float
    verify_ms: float
    decoded: bool
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., decoded: _Optional[bool] = ...) -> None: ...
