"""Messages that cross processes, torch-free: the router imports this package, and so do the
workers and the engine.

- the request vocabulary (`SamplingParams`, `FinishReason`): params.py;
- the log-probabilities of returned tokens (`TokenLogprob`, the rule they follow): logprobs.py;
- commands, router -> worker actor and worker actor -> every rank of its worker: commands.py;
- what a worker tells its router (channel events, its health answer): events.py;
- errors a worker raises to its router, matched there by type: errors.py.
"""

from tandem.messages.commands import (
    Abort,
    Connect,
    DecodeCommand,
    DecodeWorkerCommand,
    GetEndpoint,
    PerRank,
    PrefillCommand,
    PrefillWorkerCommand,
    Reserve,
    ReserveRoom,
    Route,
    RoutePrompt,
    StartPrefill,
    SubmitPrompt,
)
from tandem.messages.errors import OutOfCapacity
from tandem.messages.events import (DecodeOutput, FirstToken, PrefillResult, TransferTotals,
                                    WorkerHealth)
from tandem.messages.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from tandem.messages.params import GREEDY_TEMPERATURE, FinishReason, SamplingParams

__all__ = [
    "GREEDY_TEMPERATURE", "MAX_TOP_LOGPROBS", "Abort", "Connect", "DecodeCommand",
    "DecodeOutput", "DecodeWorkerCommand", "FinishReason", "FirstToken", "GetEndpoint",
    "OutOfCapacity", "PerRank", "PrefillCommand", "PrefillResult", "PrefillWorkerCommand",
    "Reserve", "ReserveRoom", "Route", "RoutePrompt", "SamplingParams", "StartPrefill",
    "SubmitPrompt", "TokenLogprob", "TransferTotals", "WorkerHealth",
]
