"""Scheduler: budgets, FCFS without starvation, chunked prefill, mixed batches, preemption, stop
conditions, aborts and errors. A fake model stands in for the runner; it reads its "K/V" back through
the block tables, so a wrong table or a bad prefix-cache hit changes the tokens."""

import random
import string
from collections import Counter

import pytest

from cache.blocks import BlockManager
from model.tokenizer import Tokenizer
from request import Request, RequestStatus, SamplingParams, ScheduledBatch
from scheduler.scheduler import KV_POOL_FULL, Scheduler

VOCAB = 40
EOS = 0
MASK64 = (1 << 64) - 1


def detokenize(token_ids: list[int]) -> str:
    """EOS has no text; token t >= 1 is a letter, repeated from 27 on: 1 -> "a", 4 -> "d", 28 -> "bb"."""
    return "".join(string.ascii_lowercase[(t - 1) % 26] * (1 + (t - 1) // 26) for t in token_ids if t != EOS)


class Letters:
    """The scheduler's detokenizer for these tests: `detokenize`, whole or one token at a time."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return detokenize(token_ids)

    def stream(self, skip_special_tokens: bool = True):
        return lambda token: detokenize([token])


def max_seq_len(scheduler: Scheduler) -> int:
    """The longest sequence a request may reach: max_model_len, or the whole pool (paged layout)."""
    bm = scheduler.block_manager
    return min(scheduler.max_model_len, bm.num_blocks * bm.block_size)


def tokens(text: str) -> list[int]:
    return [string.ascii_lowercase.index(c) + 1 for c in text]


class FakeModel:
    """Each position's K/V entry holds (state, token), state mixing the previous state with the token; the
    next token comes from the last state. Sampling reads the whole sequence back through the block table.
    Writing to a block that is shared or registered in the prefix cache fails at once."""

    def __init__(self, bm: BlockManager, script: dict[str, list[int]] | None = None) -> None:
        self.bm = bm
        self.script = script  # request_id -> the tokens to emit, in order, instead of the hash model
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        sampled = []
        for request, num_new, sample in zip(batch.requests, batch.num_new_tokens, batch.sample):
            start, token_ids = request.num_computed_tokens, request.token_ids
            state = self.kv[self.address(request, start - 1)][0] if start else 0
            for pos in range(start, start + num_new):
                block = self.bm.blocks[request.block_table[pos // self.bm.block_size]]
                assert block.ref_count == 1 and block.hash is None, "wrote a shared or cached block"
                state = mix(state, token_ids[pos])
                self.kv[self.address(request, pos)] = (state, token_ids[pos])
            sampled.append(self.next_token(request) if sample else None)
        return sampled

    def address(self, request: Request, pos: int) -> tuple[int, int]:
        return request.block_table[pos // self.bm.block_size], pos % self.bm.block_size

    def next_token(self, request: Request) -> int:
        entries = [self.kv[self.address(request, pos)] for pos in range(request.num_tokens)]
        assert [token for _, token in entries] == request.token_ids, "K/V read back holds other tokens"
        if self.script is not None:
            return self.script[request.request_id][len(request.output_token_ids)]
        return (((entries[-1][0] * 0x9E3779B97F4A7C15) & MASK64) >> 40) % VOCAB


def mix(state: int, token: int) -> int:
    return (state * 6364136223846793005 + token * 1442695040888963407 + 1) & MASK64


def make_request(request_id: str, prompt: list[int], **params) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=(EOS,))


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=256,
    enable_prefix_caching=True,
    admission="greedy",
) -> tuple[Scheduler, FakeModel]:
    """admission: greedy by default here, so that small pools preempt (what most of these tests are about)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    scheduler = Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, Letters(),
                          admission=admission)
    return scheduler, FakeModel(bm)


def check_step(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """Budgets and exact block accounting after schedule()."""
    bm = scheduler.block_manager
    assert batch.num_tokens <= scheduler.max_num_batched_tokens
    assert batch.num_seqs <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert len(set(map(id, batch.requests))) == batch.num_seqs
    for request, num_new in zip(batch.requests, batch.num_new_tokens):
        assert request.status is RequestStatus.RUNNING and num_new >= 1
        assert request.num_computed_tokens + num_new <= request.num_tokens
        assert len(request.block_table) == bm.num_blocks_for(request.num_computed_tokens + num_new)
    assert all(not request.block_table for request in scheduler.waiting)
    owners = Counter(block_id for request in scheduler.running for block_id in request.block_table)
    assert [block.ref_count for block in bm.blocks] == [owners[i] for i in range(bm.num_blocks)]
    assert set(bm.free_block_ids) == {i for i in range(bm.num_blocks) if owners[i] == 0}


def drive(scheduler: Scheduler, model: FakeModel, before_step=None, max_steps=100_000) -> dict[str, Request]:
    """The engine loop: schedule, run, update until nothing is unfinished; returns finished requests.
    before_step(step) may add or abort requests."""
    finished: dict[str, Request] = {}
    step = 0
    while True:
        if before_step is not None:
            before_step(step)
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        check_step(scheduler, batch)
        for request in scheduler.update(batch, model.run(batch)):
            assert request.is_finished and request.request_id not in finished
            finished[request.request_id] = request
        step += 1
        assert step < max_steps, "no progress"
    return finished


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert not scheduler.running and not scheduler.waiting


def reference(request: Request, max_model_len: int) -> Request:
    """The same request alone: one sequence, no chunking, no preemption, no prefix cache."""
    alone = Request(request.request_id, list(request.prompt_token_ids), request.params, request.eos_token_ids)
    scheduler, model = make_scheduler(
        num_blocks=max_model_len // 4 + 1,
        max_num_seqs=1,
        max_num_batched_tokens=100_000,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )
    scheduler.add(alone)
    return drive(scheduler, model)[request.request_id]


def assert_same_completion(request: Request, expected: Request) -> None:
    assert request.output_token_ids == expected.output_token_ids
    assert (request.finish_reason, request.stop_reason) == (expected.finish_reason, expected.stop_reason)
    assert request.output_text == expected.output_text


def assert_finished_at_first_stop(request: Request, max_seq_len: int) -> None:
    """An oracle independent of the scheduler: the request stopped at the first token that should stop it,
    for the reason that token gives."""
    params, output = request.params, request.output_token_ids

    def reason_after(k: int) -> str | None:
        token = output[k - 1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids):
            return "stop"
        if any(stop in detokenize(output[:k]) for stop in params.stop):
            return "stop"
        if (
            params.max_tokens is not None and k >= params.max_tokens
        ) or request.num_prompt_tokens + k >= max_seq_len:
            return "length"
        return None

    assert all(reason_after(k) is None for k in range(1, len(output)))
    assert reason_after(len(output)) == request.finish_reason
    if isinstance(request.stop_reason, str):
        full = detokenize(output)
        end = full.find(request.stop_reason)
        if params.include_stop_str_in_output:
            end += len(request.stop_reason)
        assert request.output_text == full[:end]


def random_requests(
    rng: random.Random, count: int, prefixes: list[list[int]], max_prompt: int
) -> list[Request]:
    requests = []
    for i in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        params = {
            "max_tokens": rng.choice([None, rng.randint(1, 30)]),
            "ignore_eos": rng.random() < 0.3,
            "include_stop_str_in_output": rng.random() < 0.5,
        }
        if rng.random() < 0.5:
            params["stop"] = ["".join(rng.choices("abcdef", k=2)) for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(1, VOCAB)]
        requests.append(make_request(f"r{i}", prompt[: max_prompt + 4], **params))
    return requests


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_batched_chunked_outputs_match_each_request_alone(budget):
    rng = random.Random(budget)
    scheduler, model = make_scheduler(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=budget)
    requests = random_requests(rng, 32, [[]], max_prompt=40)
    for request in requests:
        scheduler.add(request)
    finished = drive(scheduler, model)
    for request in requests:
        assert finished[request.request_id] is request
        assert_same_completion(request, reference(request, max_seq_len(scheduler)))
    assert_all_blocks_free(scheduler)


def test_budgets_hold_and_steps_mix_decode_rows_with_prefill_chunks():
    rng = random.Random(1)
    scheduler, model = make_scheduler(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=24)
    mixed_steps = 0
    original_schedule = scheduler.schedule

    def schedule_and_count():
        nonlocal mixed_steps
        batch = original_schedule()
        decode = [
            n == 1 and r.num_computed_tokens >= r.num_prompt_tokens
            for r, n in zip(batch.requests, batch.num_new_tokens)
        ]
        mixed_steps += any(decode) and not all(decode)
        return batch

    scheduler.schedule = schedule_and_count
    for request in random_requests(rng, 60, [[]], max_prompt=40):
        scheduler.add(request)
    drive(scheduler, model)  # check_step asserts the budgets and block accounting every step
    assert mixed_steps > 10
    assert_all_blocks_free(scheduler)


def test_decode_rows_go_first_and_a_prompt_gets_the_remaining_budget_in_chunks():
    scheduler, model = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    scheduler.add(a)
    scheduler.update(batch := scheduler.schedule(), model.run(batch))
    b = make_request("b", list(range(1, 21)), max_tokens=5, ignore_eos=True)
    scheduler.add(b)
    steps = []
    for _ in range(4):
        batch = scheduler.schedule()
        steps.append(([r.request_id for r in batch.requests], batch.num_new_tokens, batch.sample))
        scheduler.update(batch, model.run(batch))
    assert steps == [
        (["a", "b"], [1, 7], [True, False]),
        (["a", "b"], [1, 7], [True, False]),
        (["a", "b"], [1, 6], [True, True]),
        (["a", "b"], [1, 1], [True, True]),
    ]


def test_oldest_waiting_request_is_admitted_within_bounded_steps_under_a_flood():
    rng = random.Random(2)
    scheduler, model = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    flood_steps, bound = 300, 30
    admitted_order: list[str] = []
    head_since: dict[str, int] = {}
    longest_wait = longest_queue = 0
    counter = 0
    original_schedule = scheduler.schedule

    def schedule_and_record_admissions():
        batch = original_schedule()
        admitted_order.extend(r.request_id for r in batch.requests if r.request_id not in admitted_order)
        return batch

    def flood_and_watch(step: int) -> None:
        nonlocal counter, longest_wait, longest_queue
        if step < flood_steps:
            for _ in range(2):
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))]
                scheduler.add(make_request(f"{counter:05d}", prompt, max_tokens=rng.randint(1, 10)))
                counter += 1
        if scheduler.waiting:
            head = scheduler.waiting[0].request_id
            head_since.setdefault(head, step)
            longest_wait = max(longest_wait, step - head_since[head])
        longest_queue = max(longest_queue, len(scheduler.waiting))

    scheduler.schedule = schedule_and_record_admissions
    drive(scheduler, model, before_step=flood_and_watch)
    assert longest_queue > 100 and len(admitted_order) == counter
    assert longest_wait <= bound
    assert admitted_order == sorted(admitted_order)  # FCFS
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preempted_request_frees_its_blocks_and_resumes_token_identical(enable_prefix_caching):
    scheduler, model = make_scheduler(
        num_blocks=7, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=enable_prefix_caching
    )
    a = make_request("a", list(range(1, 9)), max_tokens=16, ignore_eos=True)
    b = make_request("b", list(range(11, 19)), max_tokens=16, ignore_eos=True)
    c = make_request("c", list(range(21, 25)), max_tokens=4, ignore_eos=True)  # waits behind them
    for request in (a, b, c):
        scheduler.add(request)
    seen = []

    def watch_preemption(step: int) -> None:
        if scheduler.num_preemptions and not seen:
            seen.append(step)
            assert scheduler.running == [a] and list(scheduler.waiting) == [b, c]
            assert b.status is RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
            assert scheduler.block_manager.num_free_blocks == 7 - len(a.block_table)

    drive(scheduler, model, before_step=watch_preemption)
    assert seen and b.num_preemptions >= 1 and a.num_preemptions == 0
    for request in (a, b, c):
        assert_same_completion(request, reference(request, max_seq_len(scheduler)))
        assert request.finish_reason == "length"
    assert len(a.output_token_ids) == len(b.output_token_ids) == 16
    assert_all_blocks_free(scheduler)


def test_the_most_recently_admitted_request_is_preempted_first():
    scheduler, model = make_scheduler(num_blocks=9, max_num_batched_tokens=64)
    requests = [
        make_request(name, [i + 1] * 8, max_tokens=12, ignore_eos=True) for i, name in enumerate("abc")
    ]
    for request in requests:
        scheduler.add(request)
    first_victim = []

    def watch(step: int) -> None:
        if scheduler.num_preemptions and not first_victim:
            first_victim.extend(r.request_id for r in scheduler.waiting)

    drive(scheduler, model, before_step=watch)
    assert first_victim == ["c"]
    assert requests[0].num_preemptions == 0 and requests[2].num_preemptions > 0


def test_prefix_cache_hit_skips_the_cached_tokens_and_gives_the_same_tokens_as_a_miss():
    prompt = list(range(1, 19))
    scheduler, model = make_scheduler()
    first = make_request("first", prompt, max_tokens=6, ignore_eos=True)
    scheduler.add(first)
    drive(scheduler, model)
    second = make_request("second", prompt, max_tokens=6, ignore_eos=True)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert second.num_cached_tokens == 16 and batch.num_new_tokens == [2]
    scheduler.update(batch, model.run(batch))
    drive(scheduler, model)
    assert first.num_cached_tokens == 0
    assert_same_completion(second, first)
    assert_same_completion(second, reference(second, max_seq_len(scheduler)))
    assert_all_blocks_free(scheduler)


def test_running_requests_share_prefix_blocks_that_are_never_written():
    scheduler, model = make_scheduler(max_num_batched_tokens=64)
    shared = list(range(1, 13))
    a = make_request("a", shared + [20], max_tokens=8, ignore_eos=True)
    scheduler.add(a)
    scheduler.update(batch := scheduler.schedule(), model.run(batch))
    b = make_request("b", shared + [30, 31], max_tokens=8, ignore_eos=True)
    scheduler.add(b)
    scheduler.update(batch := scheduler.schedule(), model.run(batch))  # FakeModel asserts ref_count == 1
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 12
    assert [scheduler.block_manager.blocks[i].ref_count for i in b.block_table[:3]] == [2, 2, 2]
    drive(scheduler, model)
    for request in (a, b):
        assert_same_completion(request, reference(request, max_seq_len(scheduler)))
    assert_all_blocks_free(scheduler)


def run_scripted(
    script: list[int], prompt: list[int] | None = None, max_model_len: int = 256, **params
) -> Request:
    scheduler, model = make_scheduler(max_model_len=max_model_len)
    model.script = {"s": script}
    request = make_request("s", prompt or [1, 2, 3], **params)
    scheduler.add(request)
    drive(scheduler, model)
    return request


def test_stop_string_truncates_the_text_before_it():
    request = run_scripted(tokens("helloworld"), max_tokens=20, stop=["ll"])
    assert (request.finish_reason, request.stop_reason, request.output_text) == ("stop", "ll", "he")
    assert request.output_token_ids == tokens("hell")


def test_include_stop_str_in_output_keeps_the_stop_string():
    request = run_scripted(tokens("helloworld"), max_tokens=20, stop=["ll"], include_stop_str_in_output=True)
    assert (request.finish_reason, request.stop_reason, request.output_text) == ("stop", "ll", "hell")


def test_stop_string_inside_one_token_cuts_that_tokens_text():
    bb = 28  # detokenizes to "bb"
    request = run_scripted([3, bb, 4], max_tokens=20, stop=["cb"], include_stop_str_in_output=True)
    assert (request.output_text, request.output_token_ids) == ("cb", [3, bb])


def test_earliest_stop_string_wins():
    request = run_scripted(tokens("abcdef"), max_tokens=20, stop=["de", "cd"])
    assert (request.stop_reason, request.output_text) == ("cd", "ab")


def test_eos_stops_with_no_stop_reason_and_its_text_left_out():
    request = run_scripted([6, 7, EOS, 8, 9], max_tokens=20)
    assert (request.finish_reason, request.stop_reason) == ("stop", None)
    assert (request.output_token_ids, request.output_text) == ([6, 7, EOS], "fg")


def test_ignore_eos_runs_to_max_tokens():
    request = run_scripted([5, EOS, 7, 8, 9], max_tokens=4, ignore_eos=True)
    assert (request.finish_reason, request.stop_reason, request.output_token_ids) == (
        "length",
        None,
        [5, EOS, 7, 8],
    )


@pytest.mark.parametrize("seed", range(3))
def test_a_row_of_several_tokens_ends_where_the_same_tokens_one_a_step_do(seed):
    """A speculative or chained row's tokens are decided at once, each against the request as the tokens
    before it would leave it: the row ends at the same token, for the same reason, with the same text, as
    the same tokens decided one a step (stop tokens, EOS, stop strings kept or cut, max_tokens)."""
    rng = random.Random(seed)
    for _ in range(20):
        params = {"max_tokens": rng.randint(1, 30), "ignore_eos": rng.random() < 0.3,
                  "include_stop_str_in_output": rng.random() < 0.5}
        if rng.random() < 0.6:
            params["stop"] = ["".join(rng.choices("abcdef", k=2)) for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(1, VOCAB)]
        script = [rng.randrange(1 if rng.random() < 0.7 else 0, 7) for _ in range(32)]
        one_a_step = run_scripted(script, **params)
        scheduler, _ = make_scheduler()
        outcome = scheduler._decide_tokens(make_request("s", [1, 2, 3], **params), 1, script)
        assert outcome.tokens == one_a_step.output_token_ids
        assert outcome.finish[:2] == (one_a_step.finish_reason, one_a_step.stop_reason)
        assert outcome.text == one_a_step.output_text


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_stops_with_that_token_as_reason(include):
    request = run_scripted([6, 7, 8], max_tokens=20, stop_token_ids=[7], include_stop_str_in_output=include)
    assert (request.finish_reason, request.stop_reason) == ("stop", 7)
    assert request.output_text == ("fg" if include else "f")


def test_stop_beats_length_on_the_same_token():
    request = run_scripted([5, 6, 7], max_tokens=2, stop_token_ids=[6])
    assert (request.finish_reason, request.stop_reason) == ("stop", 6)


@pytest.mark.parametrize("stop, expected", [(["fg"], ("stop", None, "fgh")), (["gh"], ("stop", "gh", "f"))])
def test_min_tokens_defers_eos_and_stop_strings_until_after_that_many_tokens(stop, expected):
    request = run_scripted([6, EOS, 7, 8, EOS, 9], max_tokens=20, min_tokens=3, stop=stop)
    assert (request.finish_reason, request.stop_reason, request.output_text) == expected
    assert request.output_token_ids == ([6, EOS, 7, 8, EOS] if expected[1] is None else [6, EOS, 7, 8])


def test_min_tokens_defers_a_stop_token_id():
    request = run_scripted([7, 7, 7, 8], max_tokens=20, min_tokens=2, stop_token_ids=[7])
    assert (request.finish_reason, request.stop_reason, request.output_token_ids) == ("stop", 7, [7, 7, 7])


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("ending", ["length", "stop string"])
def test_skip_special_tokens_decides_whether_special_tokens_reach_the_text(tiny_checkpoint, skip, ending):
    tokenizer = Tokenizer(tiny_checkpoint)
    script = [*tokenizer.encode("hi"), tokenizer.token_to_id("<|im_start|>"), *tokenizer.encode(" bye")]
    bm = BlockManager(64, 4, True)
    scheduler = Scheduler(bm, 8, 32, 256, tokenizer)
    stop = {"stop": ["bye"], "include_stop_str_in_output": True} if ending == "stop string" else {}
    params = SamplingParams(temperature=0, max_tokens=len(script), skip_special_tokens=skip, **stop)
    request = Request("s", [5, 6], params, eos_token_ids=(0,))
    scheduler.add(request)
    drive(scheduler, FakeModel(bm, {"s": script}))
    assert request.finish_reason == ending.split()[0] and request.output_token_ids == script
    assert request.output_text == tokenizer.decode(script, skip_special_tokens=skip)
    assert ("<|im_start|>" in request.output_text) is not skip


def test_max_model_len_ends_the_sequence_with_length():
    request = run_scripted(list(range(1, 30)), prompt=[1] * 6, max_model_len=10, max_tokens=None)
    assert request.finish_reason == "length" and request.num_tokens == 10
    assert request.stop_reason is None


def test_sequence_stops_growing_at_the_pool_size_and_says_so():
    scheduler, model = make_scheduler(num_blocks=3, block_size=4, max_model_len=100)
    assert max_seq_len(scheduler) == 12
    request = make_request("a", [1] * 5, max_tokens=None, ignore_eos=True)
    scheduler.add(request)
    drive(scheduler, model)
    assert request.finish_reason == "length" and request.num_tokens == 12
    assert request.stop_reason == KV_POOL_FULL == "kv_pool_full"


def test_a_request_that_outgrows_the_pool_alone_fails_instead_of_preempting_itself_forever():
    scheduler, model = make_scheduler(num_blocks=3, block_size=4, max_model_len=100)
    scheduler._can_grow = lambda request, num_output: True  # lift the pool cap that ends it with "length"
    request = make_request("a", [1] * 5, max_tokens=None, ignore_eos=True)
    scheduler.add(request)
    drive(scheduler, model, max_steps=50)
    assert request.finish_reason == "error" and "does not fit in the KV pool" in request.error
    assert request.num_tokens == 13 and scheduler.num_preemptions == 0
    assert_all_blocks_free(scheduler)


def test_abort_finishes_waiting_and_running_requests_and_frees_their_blocks():
    scheduler, model = make_scheduler(max_num_seqs=1)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=20, ignore_eos=True)
    b = make_request("b", [6, 7], max_tokens=20, ignore_eos=True)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(3):
        scheduler.update(batch := scheduler.schedule(), model.run(batch))
    assert scheduler.abort("b") and b.finish_reason == "abort" and b.output_token_ids == []
    assert scheduler.abort("a") and a.finish_reason == "abort"
    assert a.output_text == detokenize(a.output_token_ids) and len(a.output_token_ids) == 3
    assert not scheduler.abort("a") and not scheduler.abort("nobody")
    assert_all_blocks_free(scheduler)
    assert scheduler.has_unfinished()  # until they are handed back
    assert drive(scheduler, model) == {"a": a, "b": b}
    assert not scheduler.has_unfinished()


def test_abort_between_schedule_and_update_is_not_advanced():
    scheduler, model = make_scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=5, ignore_eos=True)
    b = make_request("b", [4, 5, 6], max_tokens=5, ignore_eos=True)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    sampled = model.run(batch)
    scheduler.abort("a")
    assert scheduler.update(batch, sampled) == [a]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0 and len(b.output_token_ids) == 1
    drive(scheduler, model)
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        ([1] * 101, "prompt has 101 tokens, more than max_model_len 100"),
        (
            [1] * 40,
            (
                "prompt has 40 tokens; with one generated token it needs 11 KV blocks of 4 tokens, "
                "more than the whole pool's 10"
            ),
        ),
    ],
)
def test_a_request_that_can_never_run_fails_alone_with_a_clear_error(prompt, message):
    scheduler, model = make_scheduler(num_blocks=10, max_model_len=100)
    good = [make_request(f"g{i}", [i + 1] * 6, max_tokens=4, ignore_eos=True) for i in range(3)]
    bad = make_request("bad", prompt)
    for request in [good[0], bad, *good[1:]]:
        scheduler.add(request)
    finished = drive(scheduler, model)
    assert (bad.finish_reason, bad.error, bad.output_token_ids) == ("error", message, [])
    assert finished["bad"] is bad
    assert all(finished[r.request_id].finish_reason == "length" for r in good)
    assert_all_blocks_free(scheduler)


def test_an_errored_request_alone_is_still_handed_back():
    scheduler, _ = make_scheduler()
    bad = make_request("bad", [])
    scheduler.add(bad)
    assert scheduler.has_unfinished()
    batch = scheduler.schedule()
    assert batch.is_empty
    assert scheduler.update(batch, []) == [bad]
    assert not scheduler.has_unfinished()


def test_a_request_id_in_use_is_refused():
    scheduler, _ = make_scheduler()
    scheduler.add(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_request("a", [2]))


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_invalid_budgets_raise_naming_the_field(field):
    kwargs = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 64, field: 0}
    with pytest.raises(ValueError, match=field):
        Scheduler(BlockManager(8), detokenizer=Letters(), **kwargs)


@pytest.mark.parametrize("admission", ["greedy", "reserve"])
def test_stress_random_requests_in_a_tiny_pool_all_finish_right_and_free_every_block(admission):
    rng = random.Random(1234)
    max_model_len = 64
    scheduler, model = make_scheduler(
        num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=max_model_len,
        admission=admission,
    )
    prefixes = [[], [rng.randrange(1, VOCAB) for _ in range(8)], [rng.randrange(1, VOCAB) for _ in range(13)]]
    requests = random_requests(rng, 520, prefixes, max_prompt=40)
    for i in rng.sample(range(len(requests)), 8):  # longer than max_model_len
        requests[i] = make_request(requests[i].request_id, [1] * (max_model_len + 1 + i))
    pending = list(requests)
    aborted: set[str] = set()

    def arrive_and_abort(step: int) -> None:
        arrivals = 40 if step == 0 else rng.randint(0 if scheduler.has_unfinished() else 1, 6)
        for _ in range(arrivals):
            if pending:
                scheduler.add(pending.pop(0))
        if step % 211 == 50 and scheduler.running:
            victim = rng.choice(scheduler.running + list(scheduler.waiting))
            assert scheduler.abort(victim.request_id)
            aborted.add(victim.request_id)

    finished = drive(scheduler, model, before_step=arrive_and_abort)
    assert len(finished) == len(requests) and len(aborted) >= 3
    assert scheduler.num_preemptions > 20
    assert sum(r.num_cached_tokens > 0 for r in requests) > 20
    for request in requests:
        assert finished[request.request_id] is request and request.is_finished
        if request.num_prompt_tokens > max_model_len:
            assert request.finish_reason == "error" and "max_model_len" in request.error
            continue
        expected = reference(request, max_seq_len(scheduler))
        if request.request_id in aborted:
            assert request.finish_reason == "abort"
            assert expected.output_token_ids[: len(request.output_token_ids)] == request.output_token_ids
            continue
        assert_same_completion(request, expected)
        assert_finished_at_first_stop(request, max_seq_len(scheduler))
    reasons = Counter(r.finish_reason for r in requests)
    assert reasons["stop"] > 50 and reasons["length"] > 50
    assert_all_blocks_free(scheduler)


def test_reserve_admission_preempts_less_than_greedy_admission_with_the_same_tokens():
    """Twelve requests of 8 prompt and 24 output tokens (8 blocks of 4 at their longest) in 24 blocks: greedy
    admission takes them in as long as their first chunks fit and preempts as they grow; reserve admits what
    the pool is expected to carry (it may still preempt: its ratio expects 70% of the remaining outputs).
    The token budget takes every prompt in the first step, so the reserve must hold from the second
    admission into the idle pool on."""
    results = {}
    for admission in ("greedy", "reserve"):
        scheduler, model = make_scheduler(num_blocks=24, max_num_batched_tokens=256, max_num_seqs=16,
                                          admission=admission)
        for i in range(12):
            scheduler.add(make_request(str(i), [1 + i] * 8, max_tokens=24, ignore_eos=True))
        finished = drive(scheduler, model)
        assert_all_blocks_free(scheduler)
        results[admission] = {k: r.output_token_ids for k, r in finished.items()}, scheduler.num_preemptions
    assert results["reserve"][1] < results["greedy"][1] / 2
    assert results["greedy"][0] == results["reserve"][0]
    assert all(len(tokens) == 24 for tokens in results["reserve"][0].values())


def test_reserve_admission_still_admits_into_an_idle_pool_a_request_it_expects_to_outgrow_it():
    """Nothing runs: the head of the queue is admitted whenever its first chunk fits (else it would wait
    forever), and grows until the pool is full."""
    scheduler, model = make_scheduler(num_blocks=6, admission="reserve")
    scheduler.add(make_request("long", [1] * 8, max_tokens=200, ignore_eos=True))
    scheduler.add(make_request("next", [2] * 4, max_tokens=4, ignore_eos=True))
    finished = drive(scheduler, model)
    assert finished["long"].finish_reason == "length" and finished["long"].stop_reason == KV_POOL_FULL
    assert len(finished["next"].output_token_ids) == 4 and scheduler.num_preemptions == 0


def test_the_reserve_ratio_decays_per_step_to_its_floor_and_returns_to_its_start_after_a_preemption():
    from scheduler.scheduler import RESERVE_DECAY_STEPS, RESERVE_FLOOR, RESERVE_INIT

    scheduler, model = make_scheduler(num_blocks=6, max_num_batched_tokens=8, admission="reserve")
    scheduler.add(make_request("a", [1] * 4, max_tokens=10, ignore_eos=True))
    for _ in range(5):
        batch = scheduler.schedule()
        scheduler.update(batch, model.run(batch))
    step = (RESERVE_INIT - RESERVE_FLOOR) / RESERVE_DECAY_STEPS
    assert scheduler.reserve_ratio == pytest.approx(RESERVE_INIT - 5 * step)
    scheduler.reserve_ratio = RESERVE_FLOOR  # a low estimate admits three that outgrow the pool together
    for i in range(3):
        scheduler.add(make_request(str(i), [2 + i] * 4, max_tokens=12, ignore_eos=True))
    ratios = []
    while scheduler.num_preemptions == 0:
        batch = scheduler.schedule()
        ratios.append(scheduler.reserve_ratio)
        scheduler.update(batch, model.run(batch))
    assert min(ratios[:-1]) == RESERVE_FLOOR and ratios[-1] == RESERVE_INIT


def test_an_unknown_admission_policy_is_named():
    with pytest.raises(ValueError, match="admission must be one of reserve, greedy"):
        Scheduler(BlockManager(8), 4, 16, 64, Letters(), admission="fifo")


def test_pipelined_speculation_reserves_tokens_in_flight_without_speculative_steps():
    """Scheduler(pipelined=True) (runner/pipelined_speculation.py): a decode row reserves the positions of up
    to k tokens in flight (fewer where max_tokens leaves less room), says how many in ScheduledBatch.reserved,
    and its step is never a speculative one; a row left mid-token is scheduled again with its reservation."""
    bm = BlockManager(64, 4, True)
    scheduler = Scheduler(bm, 8, 32, 256, Letters(), num_speculative_tokens=4, admission="greedy",
                          pipelined=True)
    short, long = make_request("short", [1, 2, 3, 4, 5], max_tokens=3), make_request("long", [6, 7, 8])
    scheduler.add(short)
    scheduler.add(long)
    batch = scheduler.schedule()
    assert batch.reserved == [5, 3] and batch.draft_lens == []  # prompt chunks reserve their own tokens
    scheduler.update(batch, [9, 10])
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1, 1] and batch.draft_lens == []
    assert batch.reserved == [2, 4]  # short: two more tokens to go; long: k
    assert len(short.block_table) == bm.num_blocks_for(short.num_computed_tokens + 2)
    assert len(long.block_table) == bm.num_blocks_for(long.num_computed_tokens + 4)
    scheduler.update(batch, [None, None], mid_token=frozenset({0, 1}))
    again = scheduler.schedule()
    assert again.reserved == [2, 4] and [r.num_computed_tokens for r in again.requests] == [5, 3]
