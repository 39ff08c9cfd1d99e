"""Stats counts capacity refusals (RESOURCE_EXHAUSTED) as `refused`, apart from validation
failures (`rejected`) and worker failures (`failed`, which the API defines as such): a request
the dispatcher refuses for capacity (the router's queue full, no worker able to hold it), one
whose prompt + max_tokens needs more KV cache than a worker has, and a worker that dies."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest
from test_router_lifecycle import FakeDispatcher, _collect, _inp, run

from tandem.router import (
    CapacityExceeded,
    Code,
    RoutedRequest,
    Router,
    RouterError,
    SamplingInput,
    TokenChunk,
)
from tandem.router.convert import stats_response


class FullDispatcher(FakeDispatcher):
    """Refuses every request for capacity, as the admission queue does when it is full."""

    async def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        self.submitted.append(request)
        raise CapacityExceeded("router: 2 requests running and 0 queued (router.max_queued)")
        yield  # an async generator, as a dispatcher's submit is


def _counts(router: Router) -> dict[str, int]:
    s = router.stats()
    return {"requests": s.num_requests, "rejected": s.num_rejected, "failed": s.num_failed,
            "refused": s.num_refused, "finished": s.num_finished}


def _code(router: Router, **kw) -> Code:
    with pytest.raises(RouterError) as e:
        run(_collect(router, _inp(**kw)))
    return e.value.code


def test_a_full_queue_is_refused_not_failed():
    router = Router(FullDispatcher(), {})
    assert _code(router) is Code.RESOURCE_EXHAUSTED
    assert _counts(router) == {"requests": 1, "rejected": 0, "failed": 0, "refused": 1,
                               "finished": 0}
    assert stats_response(router.stats()).num_refused == 1  # what the Stats RPC answers


def test_more_kv_cache_than_a_worker_has_is_refused_not_rejected():
    router = Router(FakeDispatcher(), {})  # MODEL: a worker holds 48 tokens
    assert _code(router, sampling=SamplingInput(max_tokens=46)) is Code.RESOURCE_EXHAUSTED
    assert _code(router, sampling=SamplingInput(max_tokens=0)) is Code.INVALID_ARGUMENT
    assert _counts(router) == {"requests": 0, "rejected": 1, "failed": 0, "refused": 1,
                               "finished": 0}


def test_a_worker_failure_is_still_failed():
    router = Router(FakeDispatcher(fail_after=1), {})
    assert _code(router) is Code.UNAVAILABLE
    assert _counts(router) == {"requests": 1, "rejected": 0, "failed": 1, "refused": 0,
                               "finished": 0}
