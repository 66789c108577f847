"""The command line as a new user meets it: defaults that fit the model, streamed output, a chat
that outlives its context, progress bars, one-line errors, and `hitchllm serve MODEL` with the
README's client example."""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from server_process import running_server

from hitchllm import LLM, SamplingParams, default_model_path
from hitchllm.bundled_model import DEFAULT_SERVED_MODEL_NAME
from hitchllm.config import EngineConfig
from hitchllm.cpu_threads import default_omp_wait_policy
from hitchllm.entrypoints.bench_throughput import fit_lengths
from hitchllm.entrypoints.chat_history import fit_conversation
from hitchllm.entrypoints.cli import build_parser, engine_kwargs, main, served_model
from hitchllm.entrypoints.token_stream import stream_request

ROOT = Path(__file__).resolve().parents[1]


class WriteRecorder(io.StringIO):
    """A stdout that remembers each write, to see whether text arrives piece by piece."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ---- bench throughput: default lengths fit the model ------------------------------------------

def test_default_lengths_shrink_to_fit_max_model_len():
    assert fit_lengths(None, None, 4096) == ((100, 1024), (100, 1024))
    assert fit_lengths(None, None, 512) == ((100, 256), (100, 256))
    assert fit_lengths(None, None, 48) == ((24, 24), (24, 24))
    assert fit_lengths([4, 16], None, 512) == ((4, 16), (100, 496))
    with pytest.raises(ValueError, match="exceeds max_model_len=512"):
        fit_lengths([100, 1024], [100, 1024], 512)
    with pytest.raises(ValueError, match="MIN <= MAX"):
        fit_lengths([10, 5], None, 512)


def test_bench_throughput_runs_on_the_bundled_model_with_default_lengths(capsys):
    assert main(["bench", "throughput", "--num-prompts", "1", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if line.startswith("| hitchllm"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    requests, prompt_tokens, output_tokens = int(cells[1]), int(cells[2]), int(cells[3])
    # 512-token context: a prompt of 100-256 tokens, an output of 100-256.
    assert requests == 1
    assert 100 <= prompt_tokens <= 256 and 100 <= output_tokens <= 256
    assert "Generating" not in err


def test_bench_progress_bars_go_to_stderr_on_request(llama_path, capsys, tmp_path):
    base = ["--model", llama_path, "--max-model-len", "32"]
    assert main(["bench", "throughput", *base, "--num-prompts", "3", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "Generating" in err and "3/3" in err and "Generating" not in out
    text = tmp_path / "a.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 8)
    assert main(["bench", "perplexity", *base, "--text", str(text), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "Generating" in err and "loss=" in out
    assert main(["bench", "perplexity", *base, "--text", str(text), "--no-progress"]) == 0
    assert "Generating" not in capsys.readouterr().err


# ---- generate and chat stream their tokens ----------------------------------------------------

def test_generate_streams_the_same_text_as_batch_generation(llama_path, monkeypatch):
    prompt, flags = "def f(x):", ["--max-tokens", "12", "--ignore-eos", "--block-size", "4"]
    expected = LLM(llama_path, block_size=4).generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0), use_tqdm=False,
    )[0].outputs[0].text
    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    assert main(["generate", "--model", llama_path, "--prompt", prompt, *flags]) == 0
    assert recorder.getvalue() == prompt + expected + "\n"
    pieces = [w for w in recorder.writes if w.strip()]
    assert len(pieces) >= 4, pieces  # the prompt, then text as tokens come


def test_streamed_text_never_shows_what_a_stop_string_cuts(llama_path, monkeypatch):
    llm = LLM(llama_path, block_size=4)
    full = llm.generate("a", SamplingParams(max_tokens=16, ignore_eos=True, temperature=0),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]  # a stop string that the greedy text runs into
    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    assert main(["generate", "--model", llama_path, "--prompt", "a", "--max-tokens", "16",
                 "--ignore-eos", "--block-size", "4", "--stop", stop]) == 0
    assert recorder.getvalue() == "a" + full[: full.index(stop)] + "\n"


def test_chat_streams_its_replies(llama_path, monkeypatch):
    messages = [{"role": "user", "content": "hello there"}]
    expected = LLM(llama_path, block_size=4).chat(
        messages, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0), use_tqdm=False,
    )[0].outputs[0].text
    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n"))
    assert main(["chat", "--model", llama_path, "--max-tokens", "10", "--ignore-eos",
                 "--block-size", "4"]) == 0
    assert recorder.getvalue() == expected + "\n"
    assert len([w for w in recorder.writes if w.strip()]) >= 3


def test_a_stream_left_early_aborts_its_request(llama_path):
    llm = LLM(llama_path, block_size=4)
    stream = stream_request(llm.engine, "abc", SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()  # what Ctrl-C or a closed pipe does to the loop that prints
    assert not llm.engine.scheduler.has_unfinished_requests()
    assert llm.engine.kv_cache.usage == 0
    again = llm.generate("abc", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert again.finished  # the engine carries on


def test_a_stream_interrupted_as_its_request_is_queued_aborts_it(llama_path):
    """An interrupt between the engine queuing the request and the id coming back."""
    llm = LLM(llama_path, block_size=4)
    add_request = llm.engine.add_request

    def interrupted_on_return(*args, **kwargs):
        add_request(*args, **kwargs)
        raise KeyboardInterrupt

    llm.engine.add_request = interrupted_on_return
    with pytest.raises(KeyboardInterrupt):
        next(stream_request(llm.engine, "abc", SamplingParams(max_tokens=5)))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.usage == 0


# ---- chat keeps going past the context --------------------------------------------------------

def test_fit_conversation_drops_oldest_turns_and_keeps_the_system_message():
    def chars(conversation):
        return sum(len(m["content"]) for m in conversation)

    conv = [{"role": "system", "content": "S" * 5},
            {"role": "user", "content": "u1" * 5}, {"role": "assistant", "content": "a1" * 5},
            {"role": "user", "content": "u2" * 5}, {"role": "assistant", "content": "a2" * 5},
            {"role": "user", "content": "u3" * 5}]
    assert fit_conversation(conv, chars, 1000) == (conv, 0)
    kept, dropped = fit_conversation(conv, chars, 40)
    assert (kept, dropped) == ([conv[0], *conv[3:]], 2)  # whole turns go, user first
    kept, dropped = fit_conversation(conv, chars, 15)
    assert (kept, dropped) == ([conv[0], conv[5]], 4)
    with pytest.raises(ValueError, match="send a shorter one"):
        fit_conversation(conv, chars, 14)


def test_chat_trims_old_turns_instead_of_exiting(llama_path, monkeypatch, capsys):
    turns = ["def add(a, b): return a + b", "class Engine: pass",
             "import os, sys, json", "x" * 500, "print(1)"]  # the 4th alone is too long
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n"))
    assert main(["chat", "--model", llama_path, "--max-model-len", "48", "--max-tokens", "6",
                 "--ignore-eos", "--system", "be brief", "--block-size", "4"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) >= 4  # every reply but the refused turn's (replies may wrap)
    assert "dropped the" in err and "oldest message" in err
    assert len(error_lines(err)) == 1 and "send a shorter one" in err


# ---- configuration errors ---------------------------------------------------------------------

def test_engine_config_errors_are_one_clean_line_per_field(llama_path):
    with pytest.raises(ValueError) as info:
        LLM(llama_path, max_num_seqs=0, block_size="big", schedulling_policy="fcfs")
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("block_size: ") and "'big'" in lines[0]
    assert lines[1].startswith("max_num_seqs: ") and "(got 0)" in lines[1]
    assert lines[2] == ("schedulling_policy: unknown engine argument; "
                        "did you mean scheduling_policy?")
    assert "pydantic" not in str(info.value) and "http" not in str(info.value)


@pytest.mark.parametrize("name, value", [
    ("data_parallel_size", 2), ("trust_remote_code", True),
])
def test_vllm_arguments_not_supported_yet_are_refused_by_name(llama_path, name, value):
    with pytest.raises(ValueError, match=f"^{name} is not supported yet by hitchllm"):
        EngineConfig(model=llama_path, **{name: value})


def test_vllm_arguments_with_their_no_op_value_are_accepted(llama_path):
    config = EngineConfig(model=llama_path, tensor_parallel_size=1, enable_lora=False,
                          kv_cache_dtype="auto", trust_remote_code=False)
    assert config.model == llama_path


def test_kv_cache_dtype_flag_reaches_the_engine(llama_path, capsys):
    args = build_parser().parse_args(["generate", "--model", llama_path, "--prompt", "x",
                                      "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    assert main(["generate", "--model", llama_path, "--prompt", "x", "--max-tokens", "2",
                 "--kv-cache-dtype", "fp8_e5m2", "--block-size", "4"]) == 0
    assert main(["backends", "--model", llama_path, "--device", "cpu",
                 "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    # The table names the plugin that settles the fp8 scales.
    assert "KV cache float8_e4m3fn" in out and "hitchllm-quantization" in out


def test_cli_config_errors_are_one_line_each_with_status_2(llama_path, capsys):
    assert main(["generate", "--model", llama_path, "--prompt", "x", "--max-num-seqs", "0",
                 "--data-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert error_lines(err) == [
        "error: data_parallel_size is not supported yet by hitchllm (only "
        "data_parallel_size=1 is accepted); serve replicas with `hitchllm serve "
        "--data-parallel-size N`",
        "error: max_num_seqs: Input should be greater than or equal to 1 (got 0)",
    ]
    assert main(["generate", "--model", llama_path, "--prompt", "x", "--max-tokens", "2",
                 "-tp", "1", "--block-size", "4"]) == 0


# ---- missing files: one error line ------------------------------------------------------------

def test_missing_text_file_model_and_weights_are_one_error_line(llama_path, capsys, tmp_path):
    missing = tmp_path / "missing.txt"
    assert main(["bench", "perplexity", "--model", llama_path, "--text", str(missing)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --text {missing}: No such file or directory"]
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "nowhere" in line and "config.json" in line
    no_weights = tmp_path / "no-weights"
    shutil.copytree(llama_path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    result = subprocess.run(
        [sys.executable, "-m", "hitchllm.entrypoints.cli", "generate", "--model",
         str(no_weights), "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        f"error: no weights in {no_weights}: hitchllm loads Hugging Face checkpoints with "
        "*.safetensors or pytorch_model*.bin files"]


# ---- serve MODEL ------------------------------------------------------------------------------

def serve_args(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def test_serve_takes_the_model_positionally_or_as_a_flag():
    assert served_model(serve_args(["ckpt"])) == ("ckpt", ["ckpt"])
    assert served_model(serve_args(["--model", "ckpt"])) == ("ckpt", ["ckpt"])
    assert served_model(serve_args(["ckpt", "--model", "ckpt"])) == ("ckpt", ["ckpt"])
    assert served_model(serve_args(["ckpt", "--served-model-name", "a", "b"])) == (
        "ckpt", ["a", "b"])
    assert served_model(serve_args([])) == (
        default_model_path(), [DEFAULT_SERVED_MODEL_NAME, default_model_path()])
    with pytest.raises(ValueError, match="given twice"):
        served_model(serve_args(["ckpt", "--model", "other"]))


def readme_serving_example() -> tuple[list[str], str]:
    """The README's serving section: the server command's arguments and the client code."""
    section = (ROOT / "README.md").read_text().split("## Serving", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(.*?)\n```", section, re.DOTALL).group(1)
    client = re.search(r"```python\n(.*?)\n```", section, re.DOTALL).group(1)
    words = shlex.split(command, comments=True)
    assert words[:2] == ["hitchllm", "serve"], command
    return words[2:], client


def test_readme_client_example_works_as_written():
    args, client = readme_serving_example()
    port = args.index("--port")
    args = args[:port] + args[port + 2:]  # running_server picks a free port
    with running_server(args) as url:
        code = client.replace("http://127.0.0.1:8000", url)
        printed = io.StringIO()
        with redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), {})
        assert printed.getvalue().strip()
        import openai

        listed = [m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list()]
        assert listed == [DEFAULT_SERVED_MODEL_NAME, default_model_path()]


# ---- OpenMP waits passively unless told otherwise ---------------------------------------------

def test_cli_makes_openmp_wait_passively_before_torch_loads(tmp_path):
    code = ("import os, sys\nfrom hitchllm.entrypoints.cli import main\n"
            "assert 'torch' not in sys.modules\n"
            f"main(['tiny-model', {str(tmp_path / 'm')!r}])\n"
            "assert 'torch' in sys.modules\nprint(os.environ['OMP_WAIT_POLICY'])\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "PASSIVE"


def test_a_wait_policy_the_user_chose_is_kept(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as before torch loads; restored afterwards
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not default_omp_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert default_omp_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
