"""`python -m dsv4.generate`: the embedded default runs; bad input ends in one line, exit status 2."""

import os
import subprocess
import sys

import pytest

from dsv4 import generate
from dsv4.engine.llm import LLM
from dsv4.generate import main


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path_factory.getbasetemp() / "dsv4-cache"))


def test_embedded_default_generates(capsys):
    assert main(["--prompt", "Hello", "--max-new-tokens", "4", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "time to first token" in err and "tokens/s" in err


def test_sampling_is_seeded(capsys):
    args = ["--prompt", "abc", "--max-new-tokens", "5", "--temperature", "1.0", "--top-k", "50", "--quiet"]
    main(args + ["--seed", "7"])
    first = capsys.readouterr().out
    main(args + ["--seed", "7"])
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/model", "--prompt", "x"], "does not exist"),
        (["--prompt", "   "], "prompt is empty"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["--prompt", "x", "--max-new-tokens", str(1 << 21)], "exceeds the context"),
        (["--prompt", "x", "--max-model-len", "0"], "max_model_len must be in"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(argv + ["--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_module_entry_point_reads_stdin():
    run = subprocess.run(
        [sys.executable, "-m", "dsv4.generate", "--max-new-tokens", "2", "--quiet"],
        input="Hi", capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr


def test_twenty_turn_chat_hits_the_prefix_cache_from_turn_two():
    turns = "\n".join(f"turn {i}: tell me more about item {i}" for i in range(1, 21)) + "\n"
    run = subprocess.run(
        [sys.executable, "-m", "dsv4.generate", "--chat", "--max-new-tokens", "6", "--quiet"],
        input=turns, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    reports = [line for line in run.stderr.splitlines() if line.startswith("[turn ")]
    assert len(reports) == 20
    cached = [int(line.split(":")[1].split()[0]) for line in reports]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), reports


@pytest.mark.usefixtures("kernel_twins")
def test_fast_impl_generates(capsys):
    assert main(["--impl", "fast", "--prompt", "Hello", "--max-new-tokens", "3", "--max-model-len", "64", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "3 new" in err


@pytest.mark.usefixtures("kernel_twins")
def test_enforce_eager_flag_prints_what_the_fast_impl_prints(capsys, monkeypatch):
    argv = ["--impl", "fast", "--prompt", "Hello", "--max-new-tokens", "3", "--max-model-len", "64", "--quiet"]
    assert main(argv) == 0
    expected = capsys.readouterr().out
    built = []
    monkeypatch.setattr(generate, "LLM", lambda *a, **kw: built.append(kw) or LLM(*a, **kw))
    assert main([*argv, "--enforce-eager"]) == 0
    assert capsys.readouterr().out == expected
    assert built[0]["enforce_eager"] is True


@pytest.mark.usefixtures("kernel_twins")
def test_fast_impl_runs_without_triton(capsys):
    """A CPU-only torch build brings no triton: the kernel modules import with stand-ins for it, every op runs
    its twin, and `--impl fast` prints what it prints with triton installed (where CPU ops run the twins too)."""
    argv = ["--impl", "fast", "--prompt", "Hello", "--max-new-tokens", "3", "--max-model-len", "64", "--quiet"]
    assert main(argv) == 0
    expected = capsys.readouterr().out
    no_triton = "import sys; sys.modules['triton'] = None; from dsv4.generate import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", no_triton, *argv], check=False, capture_output=True, encoding="utf-8",
                         timeout=300, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected


def test_no_swa_bounded_replay_flag(capsys):
    assert main(["--prompt", "Hello", "--max-new-tokens", "3", "--no-swa-bounded-replay", "--quiet"]) == 0


def test_chat_uses_the_checkpoints_chat_template(tiny_v41_dir, tmp_path):
    """A checkpoint's jinja chat template formats the turns; the ids still only grow, so turn 2 on
    hits the prefix cache."""
    import json
    import shutil

    model = tmp_path / "templated"
    shutil.copytree(tiny_v41_dir, model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]: {% endif %}"
    )
    config_file.write_text(json.dumps(config))
    run = subprocess.run(
        [sys.executable, "-m", "dsv4.generate", "--model", str(model), "--chat", "--max-new-tokens", "4", "--quiet"],
        input="first question here\nsecond one\nthird\n", capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    cached = [int(line.split(":")[1].split()[0]) for line in run.stderr.splitlines() if line.startswith("[turn ")]
    assert len(cached) == 3 and cached[0] == 0 and all(c > 0 for c in cached[1:]), run.stderr
