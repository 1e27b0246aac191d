from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_DDTREE: _ClassVar[Mode]
    MODE_AUTOREGRESSIVE: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_DDTREE: Mode
MODE_AUTOREGRESSIVE: Mode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("name", "dtype", "shape", "inline_data", "slot")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    inline_data: bytes
    slot: SlotRef
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., inline_data: _Optional[bytes] = ..., slot: _Optional[_Union[SlotRef, _Mapping]] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("slot", "offset", "nbytes", "sequence")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    slot: int
    offset: int
    nbytes: int
    sequence: int
    def __init__(self, slot: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class TensorBundle(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRef]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorRef, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_type", "vocab_size", "max_context", "block_size", "default_budget", "max_budget", "eos_token_id", "tp_size", "kv_capacity_tokens", "kv_page_size", "transport", "verifier_id", "eos_token_ids", "feature_bytes_per_token", "device", "tokenizer_digest")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    vocab_size: int
    max_context: int
    block_size: int
    default_budget: int
    max_budget: int
    eos_token_id: int
    tp_size: int
    kv_capacity_tokens: int
    kv_page_size: int
    transport: str
    verifier_id: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    feature_bytes_per_token: int
    device: str
    tokenizer_digest: str
    def __init__(self, model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., block_size: _Optional[int] = ..., default_budget: _Optional[int] = ..., max_budget: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., tp_size: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., transport: _Optional[str] = ..., verifier_id: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., feature_bytes_per_token: _Optional[int] = ..., device: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ...) -> None: ...
