"""kvtransfer: moves a prompt's KV pages (every layer group) and its EAGLE seed (aux slot) from a
prefill rank to the matching decode rank, over Mooncake Transfer Engine, NIXL or an in-process
fake, behind one contract (contract.py): handshake with CompatInfo, BEGIN/GO grant, bounded
batches, a completion notification after the data, deadlines everywhere, and leases so that a
page is reused only when no transfer can still write into it (leases.py).

Importing this package never imports mooncake or nixl: backends load on `create_backend(name)`.
An endpoint's listeners accept connections to the host it advertises only (bind.py).
"""

from tandem.kvtransfer.aux_slot import HEADER_BYTES, check_aux, decode_aux, encode_aux
from tandem.kvtransfer.backend import (BackendOptions, PeerEvent, TransferBackend, WritePoll,
                                       WriteStatus, backend_names, create_backend,
                                       register_backend)
from tandem.kvtransfer.bind import KV_HOST_ENV, LISTEN_ANY_ENV, default_host
from tandem.kvtransfer.compat import CompatInfo, check_compat
from tandem.kvtransfer.contract import (Destination, EndpointInfo, ErrorKind, IllegalTransition,
                                        KVReceiver, KVSender, Received, ReceiveEvent,
                                        ReceiveFailed, SendOutcome, TransferError, TransferState,
                                        advance)
from tandem.kvtransfer.endpoint import EndpointConfig, PollBackoff, poll_pause_s
from tandem.kvtransfer.faults import FailureInjection, FaultKind
from tandem.kvtransfer.layerwise import PushTiming, compare_push_modes, timed_push
from tandem.kvtransfer.layout import (MAX_BATCH_ENTRIES, AuxRegion, CopyBatch, KVLayout, KVRegion,
                                      page_runs, plan_layers)
from tandem.kvtransfer.leases import ReceiveTable, Release
from tandem.kvtransfer.metrics import TransferMetrics
from tandem.kvtransfer.receiver import DecodeReceiver
from tandem.kvtransfer.sender import PrefillSender

__all__ = [
    "HEADER_BYTES", "KV_HOST_ENV", "LISTEN_ANY_ENV", "MAX_BATCH_ENTRIES",
    "AuxRegion", "BackendOptions", "CompatInfo", "CopyBatch", "DecodeReceiver", "Destination",
    "EndpointConfig", "EndpointInfo", "ErrorKind", "FailureInjection", "FaultKind",
    "IllegalTransition", "KVLayout", "KVReceiver", "KVRegion", "KVSender", "PeerEvent",
    "PollBackoff", "PrefillSender", "PushTiming", "ReceiveEvent", "ReceiveFailed", "ReceiveTable", "Received",
    "Release", "SendOutcome", "TransferBackend", "TransferError", "TransferMetrics",
    "TransferState", "WritePoll", "WriteStatus",
    "advance", "backend_names", "check_aux", "check_compat", "compare_push_modes",
    "create_backend", "decode_aux", "default_host", "encode_aux", "page_runs", "plan_layers", "poll_pause_s",
    "register_backend",
    "timed_push",
]
