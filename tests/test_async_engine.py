"""AsyncEngine over a real EngineCore (bundled model): streaming, aborts, admission control,
a failing request, a dying loop (and /health saying so), and an idle loop that sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from loom.config import EngineConfig
from loom.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    OutputStream,
    RequestRejectedError,
)
from loom.engine.core import EngineCore
from loom.entrypoints.openai.server import ServerConfig, build_app
from loom.entrypoints.openai.serving_completion import CompletionServing
from loom.outputs import RequestOutput
from loom.sampling import SamplingParams

pytestmark = pytest.mark.integration

PROMPT = [504, 3458, 314, 2496, 30]


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(kv_cache_memory="64MiB"))


@pytest.fixture
def make_engine(core: EngineCore) -> Iterator[Callable[..., AsyncEngine]]:
    """Started AsyncEngines over the shared core; each test leaves the core empty."""
    engines = []

    def make(**options: float) -> AsyncEngine:
        engine = AsyncEngine(core, **options)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
    for request_id in list(core.scheduler.requests):
        core.abort_request(request_id)
    assert not core.has_unfinished_requests()


def request(request_id: str, max_tokens: int = 4, **params: object) -> EngineRequest:
    return EngineRequest(request_id, PROMPT, SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, **params))


async def collect(engine: AsyncEngine, *requests: EngineRequest) -> list[list[RequestOutput]]:
    stream = engine.submit(list(requests))
    return [outputs async for outputs in stream]


def client(engine: AsyncEngine) -> TestClient:
    """The app in-process, addressed as loopback (the Host a local client sends)."""
    return TestClient(build_app(engine, ServerConfig()), base_url="http://127.0.0.1",
                      raise_server_exceptions=False)


def counter(core: EngineCore, name: str, **labels: str) -> float:
    key = name + "".join(f"{{{k}={v}}}" for k, v in labels.items())
    return core.metrics.snapshot()[key]


def test_outputs_stream_as_steps_finish(make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()
    batches = asyncio.run(collect(engine, request("a", max_tokens=5)))
    tokens = [len(outputs[0].outputs[0].token_ids) for outputs in batches]
    assert tokens == sorted(tokens) and tokens[-1] == 5 and len(tokens) > 1
    assert batches[-1][0].finished and batches[-1][0].outputs[0].finish_reason == "length"


def test_requests_join_the_running_batch(make_engine: Callable[..., AsyncEngine],
                                         core: EngineCore) -> None:
    """A request submitted while another runs finishes alongside it, not after it."""
    engine = make_engine()

    async def run() -> tuple[RequestOutput, RequestOutput]:
        long_stream = engine.submit([request("long", max_tokens=30)])
        await anext(long_stream)  # running now
        short = [o async for o in engine.submit([request("short", max_tokens=3)])][-1][0]
        long_batches = [o async for o in long_stream]
        return short, long_batches[-1][0]

    short, long = asyncio.run(run())
    assert short.finished and long.finished
    assert short.metrics.finished_time < long.metrics.finished_time


def test_a_request_arrives_when_submitted_not_when_the_running_step_ends(
        make_engine: Callable[..., AsyncEngine], core: EngineCore,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop takes new requests in between steps; a request submitted during a step still
    arrived when it was submitted, so its queue time and TTFT include the wait for that step
    (as its client sees it), and its queue timeout runs from then."""
    entered, release = threading.Event(), threading.Event()
    step = core.step

    def held_step(in_flight: object) -> object:
        if not entered.is_set():
            entered.set()
            release.wait(60)
        return step(in_flight)

    monkeypatch.setattr(core, "step", held_step)
    engine = make_engine()

    async def run() -> tuple[RequestOutput, float]:
        running = engine.submit([request("running", max_tokens=3)])
        await asyncio.to_thread(entered.wait, 60)  # its first step is under way, held
        late = engine.submit([request("late", max_tokens=2)])
        submitted = time.monotonic()
        release.set()
        outputs = [o async for o in late][-1][0]
        _ = [o async for o in running]
        return outputs, submitted

    late, submitted = asyncio.run(run())
    assert late.finished
    assert late.metrics.arrival_time <= submitted < late.metrics.first_scheduled_time


def test_closing_a_stream_aborts_and_frees_blocks(make_engine: Callable[..., AsyncEngine],
                                                  core: EngineCore) -> None:
    engine = make_engine()
    aborted = counter(core, "loom:request_success_total", finished_reason="abort")

    async def run() -> None:
        stream = engine.submit([request("gone", max_tokens=500)])
        await anext(stream)
        stream.close()
        assert await anext(stream, None) is None

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while core.has_unfinished_requests() or counter(core, "loom:kv_cache_usage_perc"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert counter(core, "loom:request_success_total", finished_reason="abort") == aborted + 1


def test_queue_timeout_rejects_unscheduled_requests(make_engine: Callable[..., AsyncEngine],
                                                    core: EngineCore) -> None:
    """A timeout shorter than the trip to the first step: rejected before it is scheduled."""
    engine = make_engine(queue_timeout=1e-9)
    rejected = counter(core, "loom:request_rejected_total")
    aborted = counter(core, "loom:request_success_total", finished_reason="abort")
    with pytest.raises(RequestRejectedError, match="queue_timeout"):
        asyncio.run(collect(engine, request("late")))
    assert counter(core, "loom:request_rejected_total") == rejected + 1
    assert counter(core, "loom:request_success_total", finished_reason="abort") == aborted


def test_queue_limit_counts_the_inbox(make_engine: Callable[..., AsyncEngine],
                                      core: EngineCore) -> None:
    engine = make_engine(max_num_queued_reqs=1)
    rejected = counter(core, "loom:request_rejected_total")

    async def run() -> None:
        with engine._cond:  # hold the loop at its inbox: both requests count as waiting
            first = engine.submit([request("first")])
            with pytest.raises(RequestRejectedError, match="max_num_queued_reqs=1"):
                engine.submit([request("second")])
        assert [o async for o in first][-1][0].finished

    asyncio.run(run())
    assert counter(core, "loom:request_rejected_total") == rejected + 1


def test_admission_counts_engine_requests_and_free_slots(
        make_engine: Callable[..., AsyncEngine], core: EngineCore) -> None:
    """Four free sequence slots and room for two waiting: six single requests are taken, a
    seventh is not; a request of three engine requests that would overflow is refused whole
    (and counts three times), while one that fits is taken."""
    engine = make_engine(max_num_queued_reqs=2, max_num_seqs=4)
    rejected = counter(core, "loom:request_rejected_total")

    async def run() -> list[OutputStream]:
        with engine._cond:  # hold the loop at its inbox: nothing runs, nothing finishes
            taken = [engine.submit([request(f"s{i}")]) for i in range(6)]
            with pytest.raises(RequestRejectedError, match="max_num_queued_reqs=2"):
                engine.submit([request("s6")])
            with pytest.raises(RequestRejectedError, match="3 more"):
                engine.submit([request(f"batch{i}") for i in range(3)])
        for stream in taken:
            assert [o async for o in stream][-1][0].finished
        return taken

    asyncio.run(run())
    assert counter(core, "loom:request_rejected_total") == rejected + 4

    async def fits() -> list[list[RequestOutput]]:
        return await collect(engine, *(request(f"fits{i}") for i in range(3)))

    assert len({o.request_id for batch in asyncio.run(fits()) for o in batch}) == 3


def test_a_request_too_big_to_ever_be_admitted_is_a_400_not_a_retry(
        make_engine: Callable[..., AsyncEngine], core: EngineCore) -> None:
    """Two slots and room for two waiting: five engine requests (n=5) could never be taken,
    however long the client waits, so no 503 with Retry-After, but a 400 that says why."""
    engine = make_engine(max_num_queued_reqs=2, max_num_seqs=2)
    rejected = counter(core, "loom:request_rejected_total")
    with pytest.raises(ValueError, match="max_num_queued_reqs=2"):
        asyncio.run(collect(engine, *(request(f"n{i}") for i in range(5))))
    answer = client(engine).post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                          "n": 5})
    assert answer.status_code == 400 and "retry-after" not in answer.headers
    assert "lower n" in answer.json()["error"]["message"]
    assert counter(core, "loom:request_rejected_total") == rejected
    at_the_limit = asyncio.run(collect(engine, *(request(f"ok{i}") for i in range(4))))
    assert {o.request_id for batch in at_the_limit for o in batch if o.finished} == {
        f"ok{i}" for i in range(4)}


def test_drain_refuses_new_work_and_stop_ends_open_streams(
        make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()

    async def run() -> None:
        running = engine.submit([request("long", max_tokens=500)])
        await anext(running)
        engine.drain()
        with pytest.raises(RequestRejectedError, match="shutting down"):
            engine.submit([request("late")])
        assert await anext(running)  # what runs goes on
        engine.stop("the server is shutting down")
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in running:
                pass

    asyncio.run(run())


def test_internal_errors_say_nothing_of_the_exception(
        make_engine: Callable[..., AsyncEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug is a 500 (or, mid-stream, an error event and [DONE]) whose text names no
    exception; the log has it."""
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret internals")

    app = client(make_engine())
    monkeypatch.setattr(CompletionServing, "_prompt_tokens", boom)
    failed = app.post("/v1/completions", json={"prompt": "hi"})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "internal_server_error"
    assert "secret" not in failed.text and "RuntimeError" not in failed.text
    monkeypatch.undo()

    monkeypatch.setattr(CompletionServing, "_delta", boom)
    streamed = app.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                                 "max_tokens": 3})
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
    assert "internal_server_error" in events[-2]
    assert "secret" not in streamed.text and "RuntimeError" not in streamed.text


def test_a_request_that_cannot_run_fails_alone(make_engine: Callable[..., AsyncEngine]
                                               ) -> None:
    engine = make_engine()
    bad = EngineRequest("bad", [10**9], SamplingParams(max_tokens=2))

    async def run() -> RequestOutput:
        good = engine.submit([request("good", max_tokens=6)])
        with pytest.raises(ValueError, match="token ids"):
            await collect(engine, bad)
        return [o async for o in good][-1][0]

    assert asyncio.run(run()).outputs[0].finish_reason == "length"
    assert engine.is_alive


def test_priority_reaches_the_engine(make_engine: Callable[..., AsyncEngine], core: EngineCore,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    add_request = core.add_request
    monkeypatch.setattr(core, "add_request", lambda *args: seen.append(args) or add_request(*args))
    engine = make_engine()
    asyncio.run(collect(engine, EngineRequest("p", PROMPT, SamplingParams(max_tokens=1), 7)))
    assert seen[0][0] == "p" and seen[0][3] == 7


def test_idle_loop_sleeps(core: EngineCore) -> None:
    """Once the work is done the loop blocks on its Condition with no timeout: it sleeps
    until called, it does not poll."""
    engine = AsyncEngine(core)
    waits: list[float | None] = []
    idle = threading.Event()

    class Watched(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            idle.set()
            return super().wait(timeout)

    engine._cond = Watched()
    engine.start()
    try:
        idle.wait()  # the loop starts idle
        idle.clear()
        asyncio.run(collect(engine, request("once", max_tokens=3)))
        idle.wait()  # and goes back to sleep once the request is done
        assert engine.is_alive and set(waits) == {None}
    finally:
        engine.shutdown()


def test_a_dying_loop_fails_everyone_and_reports_dead(make_engine: Callable[..., AsyncEngine],
                                                      core: EngineCore,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object) -> list[RequestOutput]:
        raise RuntimeError("boom")

    monkeypatch.setattr(core, "step", explode)
    engine = make_engine()
    with pytest.raises(EngineDeadError, match="died") as dead:
        asyncio.run(collect(engine, request("doomed")))
    assert "boom" not in str(dead.value)  # the log has it; callers (and clients) do not
    assert not engine.is_alive
    app = client(engine)  # no lifespan: the dead loop stays
    assert app.get("/health").status_code == 503
    refused = app.post("/v1/completions", json={"prompt": "hi"})
    assert refused.status_code == 503 and "died" in refused.json()["error"]["message"]
    assert "boom" not in refused.text

    async def submit_again() -> None:
        engine.submit([request("after")])

    with pytest.raises(EngineDeadError):
        asyncio.run(submit_again())
