"""The engine's knobs on the command line: one name, one vLLM name, one type and one default each, on every
command that takes them (``kvledger.cli.engine_options.FLAGS``).

Pinned here: a vLLM user's flags and spellings parse to the same values ours do on every command; a knob
declared by hand in a command (a restated name, type or default, the defect this module removed) fails
the walk over the whole CLI; bad values are one usage line.
"""

from __future__ import annotations

from typing import Any

import click
import pytest

from kvledger.cli.engine_options import CPU_ENGINE_REFUSALS, FLAGS, RefusedKnob
from kvledger.cli.main import app, main

# Options that share a knob's name on purpose, with why: not restatements of the engine's knob.
APART = {
    # The planner's and the simulator's admission default is full reservation: they teach what a request
    # costs when its whole output is reserved; the engine commands default to vLLM's incremental growth.
    ("simulate", "policy"), ("admit", "policy"),
    # The planner's step sizes default to the chosen engine's own (vLLM's per GPU class, or ours).
    ("plan", "max_seqs"), ("plan", "max_batched_tokens"),
}


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        full = f"{prefix}{name}"
        if isinstance(cmd, click.Group):
            out += _commands(cmd, full + " ")
        else:
            out.append((full, cmd))
    return out


def _flags(names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """A knob's flag names as click splits them: (on names, off names of a boolean pair)."""
    on, off = [], []
    for n in names:
        if n.startswith("-"):
            first, _, second = n.partition("/")
            on.append(first)
            if second:
                off.append(second)
    return on, off


def _knob_of(option: click.Option) -> str | None:
    for key, (names, _) in FLAGS.items():
        if set(_flags(names)[0]) & set(option.opts) or option.name == key:
            return key
    return None


SERVERS = {"serve"}  # commands that take SERVER_DEFAULTS (vLLM's OpenAI-server defaults)


def _reference(key: str, server: bool = False) -> click.Option:
    from kvledger.cli.engine_options import engine_option

    return engine_option(key, server=server)(lambda: None).__click_params__[0]


def test_every_command_takes_each_knob_from_the_one_declaration() -> None:
    seen: dict[str, list[str]] = {}
    for name, cmd in _commands(app):
        for param in cmd.params:
            if not isinstance(param, click.Option):
                continue
            key = _knob_of(param)
            if key is None or (name, param.name) in APART:
                continue
            names, _ = FLAGS[key]
            reference = _reference(key, server=name in SERVERS)
            assert (param.opts, param.secondary_opts) == _flags(names), (name, param.opts)
            assert param.name == key, (name, param.name)
            assert param.default == reference.default, (name, param.name, param.default)
            assert type(param.type) is type(reference.type), (name, param.name, param.type)
            seen.setdefault(key, []).append(name)
    # the knobs reach the commands that build an engine or a scheduler
    assert {"generate", "serve-trace", "serve", "fleet serve", "diagnose", "quality"} <= {
        c for cmds in seen.values() for c in cmds}
    assert set(seen["kv_dtype"]) >= {"generate", "serve-trace", "serve", "quality", "simulate", "plan", "admit"}
    assert set(seen["max_num_seqs"]) >= {"serve", "fleet serve", "simulate", "serve-trace"}
    assert set(seen["max_num_batched_tokens"]) >= {"serve", "fleet serve", "simulate", "serve-trace"}
    assert set(seen["dtype"]) >= {"generate", "serve-trace", "serve", "fleet serve", "diagnose"}
    assert set(seen["kv_dtype"]) >= {"fleet serve"}
    assert set(seen["block_size"]) >= {"generate", "serve-trace", "serve", "fleet serve", "diagnose", "quality",
                                       "simulate", "plan"}
    # every command running the CPU engine answers to vLLM's GPU knobs too (refusing them: RefusedKnob)
    engines = {"generate", "serve-trace", "serve", "fleet serve"}
    assert set(seen["tensor_parallel_size"]) >= {"plan", "admit", "simulate"} | engines
    assert set(seen["gpu_memory_utilization"]) >= {"plan", "admit", "simulate"} | engines
    assert set(seen["max_model_len"]) >= {"plan", "serve", "simulate", "fleet serve"}
    assert set(seen["enable_prefix_caching"]) >= {"admit", "simulate", "serve", "serve-trace", "fleet serve"}


# A value for each knob, other than its default, that every command taking the knob accepts.
SAMPLE: dict[str, tuple[str | None, Any]] = {
    "dtype": ("bf16", "bf16"), "kv_dtype": ("fp16", "fp16"), "block_size": ("32", 32),
    "max_num_seqs": ("7", 7), "max_num_batched_tokens": ("512", 512), "max_model_len": ("4096", 4096),
    "tensor_parallel_size": ("2", 2), "gpu_memory_utilization": ("0.8", 0.8),
    "enable_prefix_caching": (None, False),
}
# The arguments a command needs before it parses at all.
REQUIRED = {"generate": ["x"], "serve-trace": ["--trace", "t.csv"], "quality": ["--kv-cache-dtype", "int8"],
            "watch": ["--events", "tcp://127.0.0.1:5557"]}


def _walk() -> list[tuple[str, str, click.Option]]:
    out = []
    for name, cmd in _commands(app):
        for param in cmd.params:
            key = _knob_of(param) if isinstance(param, click.Option) else None
            if key in SAMPLE and not (name == "quality" and key == "kv_dtype") and not isinstance(param, RefusedKnob):
                out.append((name, key, param))
    return out


@pytest.mark.parametrize("command, key, param", _walk(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_name_of_a_knob_sets_the_same_value_on_every_command(command: str, key: str,
                                                                   param: click.Option) -> None:
    """vLLM's name and ours (every name the knob has) parse to one value; no name leaves the default."""
    text, value = SAMPLE[key]
    on, off = _flags(FLAGS[key][0])
    extra = REQUIRED.get(command, [])
    default = _parsed(command, *extra)[param.name]
    for flag in (off if text is None else on):
        got = _parsed(command, *extra, *([flag] if text is None else [flag, text]))[param.name]
        assert got == value != default, (command, flag, got)
    # every flag name the knob declares is one this command's option answers to
    assert set(param.opts) | set(param.secondary_opts) == set(on) | set(off), (command, key)


def test_vllm_knob_names_reach_plan() -> None:
    """The issue's refusals: plan took none of vLLM's names for TP, utilization or the model length."""
    vllm = _parsed("plan", "--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.85",
                   "--max-model-len", "8192", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096")
    ours = _parsed("plan", "-tp", "4", "--utilization", "0.85", "--context", "8192", "--max-running", "64",
                   "--token-budget", "4096")
    assert vllm == ours
    assert (vllm["tensor_parallel_size"], vllm["gpu_memory_utilization"], vllm["max_model_len"],
            vllm["max_seqs"], vllm["max_batched_tokens"]) == (4, 0.85, 8192, 64, 4096)


def test_plan_honours_vllm_names(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    args = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json"]
    assert main([*args, "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8",
                 "--max-model-len", "4096"]) == 0
    vllm = json.loads(capsys.readouterr().out)
    assert main([*args, "--tp", "2", "--utilization", "0.8", "--context", "4096"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert vllm == ours and (vllm["tp"], vllm["context"]) == (2, 4096)


def _parsed(command: str, *args: str) -> dict[str, Any]:
    cmd: click.Command = app
    words = command.split()
    for word in words:
        cmd = cmd.commands[word]  # type: ignore[attr-defined]
    with cmd.make_context(command, list(args), resilient_parsing=False) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_vllm_and_kvledger_names_of_the_step_knobs_are_one_option(command: str) -> None:
    ours = _parsed(command, "--max-running", "7", "--token-budget", "512")
    vllm = _parsed(command, "--max-num-seqs", "7", "--max-num-batched-tokens", "512")
    assert (ours["max_num_seqs"], ours["max_num_batched_tokens"]) == (vllm["max_num_seqs"],
                                                                      vllm["max_num_batched_tokens"]) == (7, 512)
    default = _parsed(command)
    # The server steps in 1024 tokens (a prompt arriving with others starts sooner; docs/server.md); offline
    # commands keep 8192.
    assert (default["max_num_seqs"], default["max_num_batched_tokens"]) == (256, 1024 if command == "serve" else 8192)


@pytest.mark.parametrize("command", ["generate x", "serve-trace --trace t.csv", "serve", "simulate", "plan"])
def test_vllm_spellings_of_the_dtypes(command: str) -> None:
    words = command.split()
    cmd, extra = words[0], words[1:]
    assert _parsed(cmd, *extra, "--kv-cache-dtype", "int8")["kv_dtype"] == "int8"
    assert _parsed(cmd, *extra, "--kv-dtype", "int8")["kv_dtype"] == "int8"
    assert _parsed(cmd, *extra, "--kv-cache-dtype", "auto")["kv_dtype"] is None
    assert _parsed(cmd, *extra, "--kv-cache-dtype", "float16")["kv_dtype"] == "fp16"
    assert _parsed(cmd, *extra, "--kv-cache-dtype", "fp8_e4m3")["kv_dtype"] == "fp8_e4m3"
    assert _parsed(cmd, *extra)["kv_dtype"] is None


def test_generate_takes_vllms_max_tokens_for_its_output_allowance() -> None:
    assert _parsed("generate", "x", "--max-tokens", "5")["max_new"] == _parsed("generate", "x", "--max-new", "5")[
        "max_new"] == 5
    assert _parsed("generate", "x")["max_new"] == 64
    with pytest.raises(click.BadParameter):
        _parsed("generate", "x", "--max-tokens", "0")


@pytest.mark.parametrize("spelling, ours", [("bfloat16", "bf16"), ("half", "fp16"), ("float32", "fp32"),
                                            ("bf16", "bf16")])
def test_compute_dtype_spellings(spelling: str, ours: str) -> None:
    for command in ("serve", "diagnose"):
        assert _parsed(command, "--dtype", spelling)["dtype"] == ours
    assert _parsed("serve")["dtype"] == "fp32"


@pytest.mark.parametrize("args, fragment", [
    (["serve", "--dtype", "int8"], "unknown dtype 'int8': give one of fp32, bf16, fp16"),
    (["serve", "--kv-cache-dtype", "fp7"], "unknown dtype 'fp7'"),
    (["serve", "--dtype", "auto"], "unknown dtype 'auto'"),  # the compute dtype has no "auto" here
    (["quality", "--kv-cache-dtype", "bf16"], "unknown dtype 'bf16': give one of fp8_e4m3"),
    (["serve", "--block-size", "0"], "0 is not in [1, 4,096]"),
    (["serve", "--max-num-seqs", "0"], "0 is not in [1, 1,000,000]"),
    (["serve", "--pool-blocks", "10000000"], "10000000 is not in [1, 65,536]"),
    (["serve", "--port", "70000"], "70000 is not in [0, 65,535]"),
    (["serve", "--eviction", "lru"], "kvledger serve takes no --eviction: it is an engine knob, taken by "),
    (["simulate", "--max-model-len", "1"], "1 is not in [2,"),
    (["generate", "x", "--attention-backend", "flash"], "'flash' is not one of"),
    (["fleet", "serve", "--dtype", "fp8"], "unknown dtype 'fp8'"),
])
def test_bad_values_are_one_usage_line(capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvledger: error: "), err
    assert fragment in err, err


def test_an_engine_knob_has_one_default() -> None:
    from kvledger.cli.engine_options import engine_option

    with pytest.raises(ValueError, match="one default"):
        engine_option("block_size", default=32)


ENGINE_COMMANDS = {"generate": ["x"], "serve-trace": ["--trace", "t.csv"], "serve": [], "fleet serve": []}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_vllms_gpu_knobs_on_a_cpu_engine_are_refused_with_why(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM command line pasted onto a command that runs our CPU engine: --gpu-memory-utilization (any value)
    and --tensor-parallel-size above 1 are refused in one line saying why, under every name (was: 'No such
    option', or on fleet serve 'Did you mean --max-queue?'); -tp 1, what runs anyway, is accepted."""
    extra = ENGINE_COMMANDS[command]
    for flag, value, why in (("--gpu-memory-utilization", "0.9", CPU_ENGINE_REFUSALS["gpu_memory_utilization"][0]),
                             ("--utilization", "0.5", CPU_ENGINE_REFUSALS["gpu_memory_utilization"][0]),
                             ("-tp", "2", CPU_ENGINE_REFUSALS["tensor_parallel_size"][0]),
                             ("--tensor-parallel-size", "4", CPU_ENGINE_REFUSALS["tensor_parallel_size"][0])):
        assert main([*command.split(), *extra, flag, value]) == 2, (command, flag)
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "No such option" not in err, err
        name = "--gpu-memory-utilization" if "util" in flag else "--tensor-parallel-size"
        assert err == f"kvledger: error: {name} {float(value) if 'util' in flag else int(value)}: {why}\n", err
    assert "tensor_parallel_size" not in _parsed(command, *extra, "-tp", "1")  # accepted, and reaches no code
    assert "engine runs on the CPU" in _parsed_help(command)


def _parsed_help(command: str) -> str:
    cmd: click.Command = app
    for word in command.split():
        cmd = cmd.commands[word]  # type: ignore[attr-defined]
    with click.Context(cmd, info_name=command) as ctx:
        return " ".join(cmd.get_help(ctx).split())


def test_serve_trace_and_fleet_serve_take_vllms_step_and_caching_knobs() -> None:
    """serve-trace and fleet serve took none of --max-num-seqs / --max-num-batched-tokens /
    --enable-prefix-caching (fleet serve not --kv-cache-dtype nor --max-model-len); now each reaches the
    engine configuration (fleet: FleetSpec.engine_config, what every replica runs)."""
    from kvledger.fleet.spec import FleetSpec

    got = _parsed("serve-trace", "--trace", "t.csv", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                  "--no-enable-prefix-caching", "--dtype", "bfloat16")
    assert (got["max_num_seqs"], got["max_num_batched_tokens"], got["enable_prefix_caching"], got["dtype"]) == (
        8, 256, False, "bf16")
    got = _parsed("fleet serve", "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--kv-cache-dtype",
                  "fp16", "--max-model-len", "512", "--num-gpu-blocks-override", "32")
    spec = FleetSpec(pool_blocks=got["pool_blocks"], kv_dtype=got["kv_dtype"], max_model_len=got["max_model_len"],
                     prefix_caching=got["enable_prefix_caching"], max_batched_tokens=got["max_num_batched_tokens"])
    config = spec.engine_config()
    assert (config.num_blocks, config.kv_dtype, config.max_model_len, config.prefix_caching,
            config.scheduler.token_budget) == (32, "fp16", 512, False, 256)


@pytest.mark.parametrize("argv", [["admit"], ["generate", "x"], ["quality"], ["diagnose"], ["calibrate"],
                                  ["serve-trace", "--trace", "t.csv"], ["bench", "serve"]])
def test_an_engine_knob_a_command_does_not_take_names_the_commands_that_do(argv: list[str],
                                                                            capsys: pytest.CaptureFixture[str]):
    """Was: `No such option '--max-model-len'. Did you mean '--model'?` Now the knob is named as one, with the
    commands that take it; an ordinary typo keeps click's suggestion."""
    assert main([*argv, "--max-model-len", "100"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Did you mean" not in err, err
    assert err.startswith(f"kvledger: error: kvledger {' '.join(argv[:2] if argv[0] == 'bench' else argv[:1])} "
                          "takes no --max-model-len: it is an engine knob, taken by ")
    takers = err.rsplit("taken by ", 1)[1].strip().split(", ")
    assert {"plan", "serve", "simulate", "fleet serve"} <= set(takers) and argv[0] not in takers
    assert main(["admit", "--modle", "x"]) == 2
    assert "Did you mean" in capsys.readouterr().err
