from ddtree.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("draft_id", "feature_layer_ids", "hidden_size", "vocab_size", "transports", "draft_ring", "draft_ring_slot_bytes", "draft_ring_slots")
    DRAFT_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RING_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    draft_id: str
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    vocab_size: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    draft_ring: str
    draft_ring_slot_bytes: int
    draft_ring_slots: int
    def __init__(self, draft_id: _Optional[str] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., draft_ring: _Optional[str] = ..., draft_ring_slot_bytes: _Optional[int] = ..., draft_ring_slots: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("transport", "verifier_ring", "verifier_ring_slot_bytes", "verifier_ring_slots", "model_type", "vocab_size", "hidden_size", "max_context", "eos_token_id", "tp_size", "kv_capacity_tokens", "kv_page_size", "verifier_id", "eos_token_ids", "feature_bytes_per_token", "device", "target_digest", "step_socket", "step_socket_key")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_RING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_RING_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_RING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_KEY_FIELD_NUMBER: _ClassVar[int]
    transport: str
    verifier_ring: str
    verifier_ring_slot_bytes: int
    verifier_ring_slots: int
    model_type: str
    vocab_size: int
    hidden_size: int
    max_context: int
    eos_token_id: int
    tp_size: int
    kv_capacity_tokens: int
    kv_page_size: int
    verifier_id: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    feature_bytes_per_token: int
    device: str
    target_digest: str
    step_socket: str
    step_socket_key: bytes
    def __init__(self, transport: _Optional[str] = ..., verifier_ring: _Optional[str] = ..., verifier_ring_slot_bytes: _Optional[int] = ..., verifier_ring_slots: _Optional[int] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., tp_size: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., verifier_id: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., feature_bytes_per_token: _Optional[int] = ..., device: _Optional[str] = ..., target_digest: _Optional[str] = ..., step_socket: _Optional[str] = ..., step_socket_key: _Optional[bytes] = ...) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "reserve_tokens", "prompt_continues", "prompt_offset")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    reserve_tokens: int
    prompt_continues: bool
    prompt_offset: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., prompt_continues: _Optional[bool] = ..., prompt_offset: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sequence", "prefills", "verify_ids", "trees", "release", "released_slots")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_IDS_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    prefills: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    verify_ids: _containers.RepeatedScalarFieldContainer[str]
    trees: _common_pb2.TensorBundle
    release: _containers.RepeatedScalarFieldContainer[str]
    released_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence: _Optional[int] = ..., prefills: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ..., verify_ids: _Optional[_Iterable[str]] = ..., trees: _Optional[_Union[_common_pb2.TensorBundle, _Mapping]] = ..., release: _Optional[_Iterable[str]] = ..., released_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ItemResult(_message.Message):
    __slots__ = ("request_id", "token_ids", "committed", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed: int
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., committed: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("sequence", "prefills", "verifies", "features", "released_slots", "verify_ms")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    prefills: _containers.RepeatedCompositeFieldContainer[ItemResult]
    verifies: _containers.RepeatedCompositeFieldContainer[ItemResult]
    features: _common_pb2.TensorBundle
    released_slots: _containers.RepeatedScalarFieldContainer[int]
    verify_ms: float
    def __init__(self, sequence: _Optional[int] = ..., prefills: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ..., verifies: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.TensorBundle, _Mapping]] = ..., released_slots: _Optional[_Iterable[int]] = ..., verify_ms: _Optional[float] = ...) -> None: ...
