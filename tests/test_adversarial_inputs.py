"""Bad inputs a new user (or a hostile checkpoint) hands the engine, through the public API and the command
line, on the embedded tiny checkpoint on CPU. Each one must give a clear error naming what is wrong (the
field, option, file, tensor, template or bound), and leave an engine that generates the same greedy tokens
as before with every KV block free: chat templates that run away in time or memory whatever they call,
sampling params changed after they were built, memory-sized options past what the machine has, broken
checkpoints, eval flags and protocols, exceptions inside a step's commit, and the CLI's prompts file."""

import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.paired_eval import paired_eval
from cli import main, read_prompts_file
from engine import DEFAULT_MODEL, Engine, SamplingParams
from model import chat_template
from tests.conftest import ROOT

PROMPTS = ["4821+3907=", "Hello", "A looped language model"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "What is 12+30?"}]
CPU = ["--device", "cpu", "--threads", "1"]


@pytest.fixture(scope="module")
def engine():
    with Engine(DEFAULT_MODEL, device="cpu", dtype="float32", verbose=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def baseline(engine):
    """What the engine generates before any bad input: greedy tokens, and a chat answer."""
    tokens = [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
    answer = engine.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return tokens, answer


def assert_unharmed(engine, baseline):
    """Every KV block free, nothing queued or owed, and the same greedy tokens and chat answer as before."""
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and all(b.ref_count == 0 for b in manager.blocks)
    assert not engine.has_unfinished() and not engine.outputs.requests and not engine.runner.generators
    tokens, answer = baseline
    assert [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == tokens
    assert engine.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == answer
    assert manager.num_free_blocks == manager.num_blocks


def copy_checkpoint(tmp_path, name="ckpt"):
    return shutil.copytree(DEFAULT_MODEL, tmp_path / name)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# -- chat templates: bounded in time, memory and output, whatever they call ------------------------------

WALL_TIME = "the bound on a chat template's wall time"
MEMORY = "the bound on a chat template's memory"
OUTPUT = "the bound on a rendered chat template"
ANY_BOUND = f"({WALL_TIME}|{MEMORY}|{OUTPUT})"
ON_LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"),
                              reason="the memory bound is Linux's address-space limit")

RUNAWAY_TEMPLATES = [
    pytest.param("{{ lipsum(10**6) }}", ANY_BOUND, id="lipsum-million"),
    pytest.param("{{ lipsum(10**4) }}", ANY_BOUND, id="lipsum-ten-thousand"),
    pytest.param("{% for i in range(99999) %}{% set x = ('word ' * (20000 + i))|wordwrap(3) %}{% endfor %}",
                 WALL_TIME, id="wordwrap-loop"),
    pytest.param("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                 WALL_TIME, id="silent-nested-loops"),
    pytest.param("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}{{ ns.s | length }}", MEMORY, id="concat-doubling", marks=ON_LINUX),
    pytest.param("{% set big = 'a' * 10**9 %}", MEMORY, id="repeat-a-billion", marks=ON_LINUX),
    pytest.param("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                 "{% endfor %}{{ ns.l | tojson }}", ANY_BOUND, id="shared-list-doubling-tojson"),
    pytest.param("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", OUTPUT, id="long-output"),
]


@pytest.mark.parametrize("template, bound", RUNAWAY_TEMPLATES)
def test_a_runaway_chat_template_is_stopped_at_a_bound_that_the_error_names(engine, baseline, monkeypatch,
                                                                             template, bound):
    if bound == WALL_TIME:
        monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 0.5)
    given = "conversation 0: chat template given as chat_template"
    with pytest.raises(ValueError, match=rf"^{given}: .*{bound}"):
        engine.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=template)
    assert_unharmed(engine, baseline)


def test_a_checkpoints_runaway_template_names_its_file_in_the_api_and_on_the_command_line(
        engine, baseline, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 0.5)
    path = copy_checkpoint(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ lipsum(10**6) }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    named = rf"chat template of {path / 'tokenizer_config.json'}: .*{ANY_BOUND}"
    with Engine(path, device="cpu", verbose=False) as hostile:
        with pytest.raises(ValueError, match=named):
            hostile.chat(MESSAGES, GREEDY, use_tqdm=False)
        assert hostile.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline[0][0]
    status, out, err = run_cli(capsys, "generate", "--model", str(path), "--chat", "hi", *CPU)
    last = err.splitlines()[-1]  # after the engine's start-up line
    assert status == 1 and out == "" and re.match(rf"error: {named}", last) and "Traceback" not in err
    assert_unharmed(engine, baseline)


def test_a_template_that_escapes_the_sandbox_or_raises_is_a_clear_error(engine, baseline):
    for template, message in [
            ("{{ ''.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
            ("{{ raise_exception('no system role') }}", "TemplateError: no system role"),
            ("{% for %}", "TemplateSyntaxError")]:
        with pytest.raises(ValueError, match=f"chat template given as chat_template: {message}"):
            engine.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=template)
    assert_unharmed(engine, baseline)


# -- sampling params: checked when a request is added, not only when built --------------------------------

@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 2), ("max_tokens", -1), ("seed", -1),
                                          ("top_k", -2), ("min_p", float("nan")), ("n", 0), ("stop", 5),
                                          ("stop_token_ids", 5), ("stop", [""]), ("logprobs", -1)])
def test_params_changed_after_they_were_built_are_checked_when_a_request_is_added(engine, baseline, field,
                                                                                    value):
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=4)
    setattr(params, field, value)
    named = rf"SamplingParams\.{field} must"
    with pytest.raises(ValueError, match=named):
        engine.generate(PROMPTS, params, use_tqdm=False)
    with pytest.raises(ValueError, match=named):
        engine.add_request(PROMPTS[0], params)
    with pytest.raises(ValueError, match=named):
        engine.stream(PROMPTS, [GREEDY, params, GREEDY])
    assert_unharmed(engine, baseline)


@pytest.mark.parametrize("field, value", [("stop", 5), ("stop_token_ids", 5), ("stop_token_ids", "ab"),
                                          ("stop", [5]), ("stop_token_ids", [1.5])])
def test_a_stop_of_the_wrong_type_is_a_value_error_naming_the_field(field, value):
    got = re.escape(repr(value))
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} must be .*, got {got}$"):
        SamplingParams(**{field: value})


def test_a_queued_request_keeps_the_params_it_was_added_with(engine, baseline):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    request_id = engine.add_request(PROMPTS[0], params)
    params.max_tokens, params.temperature = 1, 5.0  # the caller's object; the queued request has a copy
    finished = []
    while engine.has_unfinished():
        finished += [out for out in engine.step() if out.finished]
    assert [out.request_id for out in finished] == [request_id]
    assert finished[0].outputs[0].token_ids == baseline[0][0][:6]
    assert_unharmed(engine, baseline)


# -- memory-sized options: checked against the machine before anything is allocated -----------------------

@pytest.mark.parametrize("options, named", [({"num_kv_blocks": 10**12}, "num_kv_blocks=1000000000000"),
                                            ({"kv_cache_gib": 1e6}, "kv_cache_gib=1000000.0"),
                                            ({"loops": 10**6}, "loops=1000000"),
                                            ({"block_size": 10**9}, "block_size=1000000000")])
def test_a_pool_larger_than_the_machine_is_refused_by_option_before_allocating(engine, baseline, options,
                                                                               named):
    past_training = pytest.warns(UserWarning, match="exceeds the 4 loops") if "loops" in options \
        else nullcontext()
    refused = rf"the KV pool would take .*{named}.*more than the .* GiB of memory available on cpu; lower"
    with past_training, pytest.raises(ValueError, match=refused):
        Engine(device="cpu", verbose=False, **options)
    assert_unharmed(engine, baseline)


def test_the_command_line_names_a_pool_option_past_the_machine_in_one_line(capsys):
    status, out, err = run_cli(capsys, "generate", "--num-kv-blocks", str(10**12), *CPU)
    assert status == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("error: the KV pool would take") and "num_kv_blocks=1000000000000" in err


# -- checkpoints: every error names the file (and the tensor) ---------------------------------------------

def truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])


def write_weight(path, name, value, index=(0, 0)):
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name][index] = value
    save_file(tensors, str(path / "model.safetensors"))


BROKEN_CHECKPOINTS = [
    pytest.param(truncate, r"model\.safetensors is not a readable safetensors file \(.*incomplete metadata",
                 id="truncated-weights"),
    pytest.param(lambda p: (p / "model.safetensors").write_bytes(b"\xff" * 64),
                 r"model\.safetensors is not a readable safetensors file", id="garbage-weights"),
    pytest.param(lambda p: (p / "tokenizer.json").write_text('{"model": {1: 2}}'),
                 r"tokenizer\.json is not a tokenizer the tokenizers library can read: key must be a string",
                 id="malformed-tokenizer"),
    pytest.param(lambda p: (p / "config.json").write_text("{"), r"config\.json is not valid JSON",
                 id="malformed-config"),
    pytest.param(lambda p: write_weight(p, "model.layers.1.mlp.down_proj.weight", float("nan"), (3, 5)),
                 r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' in \S+model\.safetensors holds 1 "
                 r"non-finite value", id="nan-weight"),
    pytest.param(lambda p: write_weight(p, "model.norm.weight", float("-inf"), 7),
                 r"tensor 'model\.norm\.weight' in \S+ holds 1 non-finite value", id="inf-weight"),
]


@pytest.mark.parametrize("damage, message", BROKEN_CHECKPOINTS)
def test_a_broken_checkpoint_is_refused_naming_the_file(engine, baseline, tmp_path, capsys, damage, message):
    path = copy_checkpoint(tmp_path)
    damage(path)
    with pytest.raises(ValueError, match=message):
        Engine(path, device="cpu", verbose=False)
    status, out, err = run_cli(capsys, "generate", "--model", str(path), *CPU)
    assert status == 1 and out == "" and err.startswith("error: ") and str(path) in err
    assert_unharmed(engine, baseline)


def test_nan_weights_load_with_the_check_turned_off(tmp_path):
    path = copy_checkpoint(tmp_path)
    write_weight(path, "model.norm.weight", float("nan"), 7)
    with Engine(path, device="cpu", verbose=False, check_finite_weights=False) as unchecked:
        assert torch.isnan(unchecked.model.norm.weight).sum() == 1


def test_weights_beyond_the_engines_dtype_are_named_as_such(tmp_path):
    path = copy_checkpoint(tmp_path)
    write_weight(path, "model.layers.0.mlp.up_proj.weight", 1e6)  # finite in fp32, inf in fp16
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' in \S+ holds 1 "
                                         r"value\(s\) beyond the range of torch\.float16"):
        Engine(path, device="cpu", dtype="float16", verbose=False)


@pytest.mark.parametrize("name, what", [("config.json", "config"), ("tokenizer.json", "tokenizer"),
                                        ("tokenizer_config.json", "tokenizer config"),
                                        ("generation_config.json", "generation_config.json")])
def test_a_config_or_tokenizer_link_out_of_the_checkpoint_is_refused(engine, baseline, tmp_path, name, what):
    path = copy_checkpoint(tmp_path)
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    shutil.move(path / name, outside)
    (path / name).symlink_to(outside)
    with pytest.raises(ValueError, match=rf"the checkpoint's {what} is '{name}', a link to "
                                         rf"\S+outside/{name}, outside the checkpoint directory"):
        Engine(path, device="cpu", verbose=False)
    assert_unharmed(engine, baseline)


def test_an_empty_model_name_is_refused_not_read_as_the_current_directory(engine, baseline, tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(copy_checkpoint(tmp_path))  # it would load, were '' the current directory
    for model in ("", "  "):
        with pytest.raises(ValueError, match=rf"model must be a checkpoint directory or a Hugging Face "
                                             rf"repo id, got {model!r}"):
            Engine(model, device="cpu", verbose=False)
    assert_unharmed(engine, baseline)


def test_the_real_command_line_prints_one_line_not_a_traceback_for_a_truncated_checkpoint(tmp_path):
    path = copy_checkpoint(tmp_path)
    truncate(path)
    result = subprocess.run([sys.executable, "engine.py", "generate", "--model", str(path), *CPU], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: {path / 'model.safetensors'}")


# -- the eval command line -----------------------------------------------------------------------------

ADDITION = ROOT / "benchmarks" / "tasks" / "addition.json"


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_refuses_a_limit_below_one(capsys, limit):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--protocol", str(ADDITION), "--engine", "device=cpu", f"--limit={limit}"])
    assert exit_.value.code == 2
    assert f"argument --limit: must be an integer >= 1, got '{limit}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=rf"limit must be an integer >= 1 \(the protocol's first N items\), "
                                         rf"got {limit}"):
        paired_eval(ADDITION, {}, {}, common={"device": "cpu"}, limit=int(limit))


@pytest.mark.parametrize("template, message", [
    ("{question} {answer}", "names the field {answer}"), ("Q: {0}", "names the field {0}"),
    ("{question", "is not a format string"), ("no field", "must contain {question}")])
def test_eval_names_a_protocol_template_with_a_field_an_item_lacks(tmp_path, capsys, template, message):
    protocol = json.loads(ADDITION.read_text())
    protocol["template"] = template
    shutil.copy(ADDITION.with_name("addition.jsonl"), tmp_path / "addition.jsonl")
    (tmp_path / "protocol.json").write_text(json.dumps(protocol, indent=1))
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--protocol", str(tmp_path / "protocol.json"), "--engine", "device=cpu",
              "--limit", "2"])
    error = str(exit_.value.code)
    assert error.startswith(f"error: {tmp_path / 'protocol.json'}:") and f"template {template!r}" in error
    assert message in error


# -- exceptions inside a step's commit section ----------------------------------------------------------

COMMIT_PARTS = [("runner", "release"), ("runner", "commit"), ("block_manager", "cache_full_blocks"),
                ("scheduler", "apply"), ("block_manager", "free")]
WORKLOAD = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, seed=11, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, loop_trace=True)]


def run_workload(engine, error=None):
    """Add the workload, step until done, stepping on after `error`; each request finishes once. Returns
    per request (tokens, text, finish_reason, logprob and trace counts), and how many steps raised."""
    ids = [engine.add_request(prompt, params) for prompt, params in zip(PROMPTS, WORKLOAD)]
    finished, raised = {}, 0
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except BaseException as err:
            if error is None or not isinstance(err, error):
                raise
            raised += 1
            continue
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished
                c = out.outputs[0]
                finished[out.request_id] = (c.token_ids, c.text, c.finish_reason, len(c.logprobs or []),
                                            len(c.traces or []))
    assert sorted(finished) == sorted(ids)
    return [finished[i] for i in ids], raised


@pytest.fixture(scope="module")
def fault_free(engine):
    """The workload's outputs without a fault."""
    return run_workload(engine)[0]


@pytest.mark.parametrize("owner, name", COMMIT_PARTS)
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_inside_the_commit_loses_no_output_and_keeps_seeded_tokens(engine, baseline, fault_free,
                                                                                 monkeypatch, owner, name,
                                                                                 error):
    """Not only a (deferred) Ctrl-C: any exception raised by a part of the commit, at its first, middle or
    last call of a run. Stepping on, every request finishes once with the fault-free outputs (the seeded
    request's tokens included), and every block is free."""
    target = getattr(engine, owner)
    real, calls, armed, in_commit = getattr(target, name), [0], [None], [name != "free"]

    def hooked(*args, **kwargs):
        if in_commit[0]:
            calls[0] += 1
            if calls[0] == armed[0]:
                raise error(f"injected into {owner}.{name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, hooked)
    if name == "free":  # counted inside the commit only (schedule() frees blocks too)
        apply = engine.scheduler.apply

        def applying(*args, **kwargs):
            in_commit[0] = True
            try:
                return apply(*args, **kwargs)
            finally:
                in_commit[0] = False

        monkeypatch.setattr(engine.scheduler, "apply", applying)
    run_workload(engine)
    total, calls[0] = calls[0], 0
    assert total > 0
    manager = engine.block_manager
    for nth in sorted({1, (total + 1) // 2, total}):
        armed[0], calls[0] = nth, 0
        outputs, raised = run_workload(engine, error)
        assert raised == 1 and outputs == fault_free, (nth, total)
        assert manager.num_free_blocks == manager.num_blocks and not engine.has_unfinished()
    assert_unharmed(engine, baseline)


# -- the generate command line and streams --------------------------------------------------------------

@pytest.mark.parametrize("field", ["index", "text", "finish_reason"])
def test_a_prompts_file_row_with_an_output_field_is_refused_not_overwritten(tmp_path, capsys, field):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1+1=", "id": "a"}, {"prompt": "2+2=", field: 7}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, out, err = run_cli(capsys, "generate", "--prompts-file", str(path), *CPU)
    assert status == 1 and out == ""
    assert f"error: --prompts-file {path}, line 2: field {field!r} is one the output line sets" in err
    with pytest.raises(ValueError, match=f"line 2: field {field!r}"):
        read_prompts_file(path)


def test_an_abandoned_stream_leaves_nothing_unfinished_at_once(engine, baseline):
    stream = engine.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not engine.has_unfinished()
    assert engine.step() == []
    assert_unharmed(engine, baseline)
