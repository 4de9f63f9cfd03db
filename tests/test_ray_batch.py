"""examples/ray_batch.py on a local Ray started here: two actors, one Engine each, against one Engine in this
process. Needs the Ray extra (pip install -e ".[ray]"); CI installs it, so there a missing Ray fails."""

import json
import os
from pathlib import Path

import pytest

if os.environ.get("CI"):
    import ray
else:
    ray = pytest.importorskip("ray")

from engine import Engine, SamplingParams  # noqa: E402
from examples import ray_batch  # noqa: E402

NUM_PROMPTS = 64
EMPTY, MISSING = 7, 40  # rows whose prompt is "" and absent
LOOPS = 3
MAX_TOKENS = 6
ROOT = Path(__file__).resolve().parent.parent
# Ray 2.60's DataContext warns about its own defaults.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")


def prompt_of(i: int) -> str:
    return f"{i * 7 % 50}+{i * 13 % 90}=" if i % 3 else f"Once upon a time there was a fox number {i}"


@pytest.fixture(scope="module")
def local_ray():
    # The workers import this repository's modules from wherever pytest was started.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"id": i} if i == MISSING else {"id": i, "prompt": "" if i == EMPTY else prompt_of(i)}
            for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def results(local_ray, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "out"
    ray_batch.main(["--input", str(prompts_file), "--output", str(out), "--device", "cpu",
                    "--num-workers", "2", "--cpus-per-worker", "0.5", "--batch-size", "8",
                    "--max-tokens", str(MAX_TOKENS), "--loops", str(LOOPS), "--loop-trace",
                    "--engine-arg", "enable_prefix_caching=false"])
    files = sorted(out.glob("*.json"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_every_prompt_comes_back_once_in_input_order(results):
    assert [row["id"] for row in results] == list(range(NUM_PROMPTS))


def test_greedy_tokens_match_one_engine(results):
    ids = [i for i in range(NUM_PROMPTS) if i not in (EMPTY, MISSING)]
    with Engine(device="cpu", loops=LOOPS, enable_prefix_caching=False, verbose=False) as engine:
        expected = engine.generate([prompt_of(i) for i in ids], SamplingParams(temperature=0,
                                                                               max_tokens=MAX_TOKENS),
                                   use_tqdm=False)
    for i, want in zip(ids, expected):
        row = results[i]
        assert row["prompt"] == prompt_of(i)
        assert row["token_ids"] == want.outputs[0].token_ids, f"prompt {i}"
        assert (row["text"], row["finish_reason"]) == (want.outputs[0].text, want.outputs[0].finish_reason)


def test_bad_prompts_get_error_rows_while_the_rest_finish(results):
    assert (results[EMPTY]["finish_reason"], results[EMPTY]["error"]) == ("error", "prompt is empty")
    assert (results[MISSING]["finish_reason"], results[MISSING]["error"]) == ("error", "prompt is missing")
    assert results[EMPTY]["token_ids"] == results[MISSING]["token_ids"] == []
    rest = [row for row in results if row["id"] not in (EMPTY, MISSING)]
    assert all(row["finish_reason"] in ("length", "stop") and row["error"] is None for row in rest)
    assert all(1 <= len(row["token_ids"]) <= MAX_TOKENS for row in rest)


def test_rows_carry_the_engine_settings_and_loop_statistics(results):
    rest = [row for row in results if row["id"] not in (EMPTY, MISSING)]
    assert {(row["loops"], row["exit_policy"]) for row in results} == {(LOOPS, "full")}
    assert {(row["mean_loops_run"], row["mean_readout_loops"]) for row in rest} == {(LOOPS, LOOPS)}


def test_workers_holding_every_cpu_are_refused_before_they_deadlock(local_ray):
    with pytest.raises(ValueError, match="leave none of the cluster's 2 CPUs"):
        ray_batch.check_capacity(2, 1.0, "cpu")
    ray_batch.check_capacity(2, 0.5, "cpu")


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a"}', '{"prompt": "b"', '{"prompt": "c"}'], r"prompts.jsonl:2: not valid JSON"),
    (['{"prompt": "a"}', '["b"]'], r"prompts.jsonl:2: expected a JSON object, got list"),
    (['{"prompt": "a"}', '', '{"prompt": 12}'], r"prompts.jsonl:3: prompt must be a string, got 12"),
    (['{"text": "a"}'], r"prompts.jsonl: no 'prompt' column \(columns: text\)"),
    (['{"prompt": "a", "error": 1}'], r"prompts.jsonl: column\(s\) error would be overwritten"),
])
def test_malformed_prompts_file_is_refused_naming_the_line(tmp_path, lines, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        ray_batch.check_prompts(path)


def test_parquet_prompt_column_must_hold_strings(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [1, 2]}), path)
    with pytest.raises(ValueError, match="column 'prompt' must hold strings, not int64"):
        ray_batch.check_prompts(path)


def test_engine_args_parse_as_json_else_string():
    assert ray_batch.parse_engine_args(["block_size=32", "kv_sharing=last", "enable_prefix_caching=false"]) \
        == {"block_size": 32, "kv_sharing": "last", "enable_prefix_caching": False}
    with pytest.raises(ValueError, match="must be KEY=VALUE"):
        ray_batch.parse_engine_args(["loops"])
    with pytest.raises(ValueError, match="use --exit-policy instead"):
        ray_batch.parse_engine_args(["exit_policy=full"])
    with pytest.raises(ValueError, match="'loop' is not an Engine argument"):
        ray_batch.parse_engine_args(["loop=3"])



def test_parquet_reads_and_writes_round_trip(local_ray, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2], "prompt": ["12", "a b"]}), tmp_path / "prompts.parquet")
    ray_batch.check_prompts(tmp_path / "prompts.parquet")
    ds = ray_batch.read_prompts(tmp_path / "prompts.parquet")
    ray_batch.write_results(ds, tmp_path / "out", "parquet")
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert rows == [{"id": 1, "prompt": "12"}, {"id": 2, "prompt": "a b"}]
    with pytest.raises(ValueError, match="already exists"):
        ray_batch.write_results(ds, tmp_path / "out", "parquet")
