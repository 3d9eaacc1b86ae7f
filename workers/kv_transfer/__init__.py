"""Moving one request's KV cache from a prefill engine replica to a decode engine replica.

`layout` is the wire format (header and payload, `pack_kv`/`unpack_kv`), `base` the sender and receiver
interfaces, `object_store`, `p2p` (gloo/nccl point to point) and `cuda_ipc` (one GPU or host, over
`ipc_share`) the transports, `factory` picks one by name. Submodules import each other, never this
package; it only re-exports the names used elsewhere.
"""

from workers.kv_transfer.base import KVReceiver, KVSender, KVTransferError, KVTransferTimeout
from workers.kv_transfer.factory import TRANSPORTS, make_receiver, make_sender, resolve_transport
from workers.kv_transfer.layout import KVLayout, KVTransferMeta, pack_kv, unpack_kv

__all__ = ["KVLayout", "KVReceiver", "KVSender", "KVTransferError", "KVTransferMeta", "KVTransferTimeout",
           "TRANSPORTS", "make_receiver", "make_sender", "pack_kv", "resolve_transport", "unpack_kv"]
