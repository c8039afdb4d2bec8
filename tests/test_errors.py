"""Bad input: one clear message each, no traceback from the CLI, nothing lost."""
import json

import pytest
import torch

from forerun import cli
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError, ContextLengthError, ModelLoadError
from forerun.llm import LLM
from tests.tiny import tiny_model


def _cli_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("forerun: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--k", "-1"], "--k must be an integer >= 0"),
        (["--temperature", "-0.5"], "--temperature must be"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--ngram-min", "5"], "need 1 <= --ngram-min <= --ngram-max"),
        (["--method", "nonsense"], "unknown speculative method"),
        (["--method", "ngrams"], "(did you mean 'ngram'?)"),
        (["--model", "/no/such/model"], "not found"),
        (["--model", "smollm-135m"], "(did you mean 'smollm2-135m'?)"),
        (["--model", "/no/such/file.gguf"], "GGUF file not found"),
    ],
)
def test_cli_rejects_bad_parameters(capsys, flags, words):
    err = _cli_error(capsys, ["generate", "hi", *flags])
    assert words in err
    for python_name in ("num_speculative_tokens", "top_p", "max_tokens", "ngram_min"):  # the flags, not the parameters
        assert python_name not in err


def test_a_missed_model_name_lists_the_embedded_models(capsys):
    from forerun.embedded import EMBEDDED_MODELS

    err = _cli_error(capsys, ["generate", "hi", "--model", "smollm-135m"])
    assert all(name in err for name in EMBEDDED_MODELS)


def test_errors_name_the_flags_not_the_parameters():
    from forerun.cli import _subparser, build_parser
    from forerun.cli_args import in_flags

    generate = _subparser(build_parser(), "generate")
    assert (in_flags("method 'draft_model' needs draft_model= (a model folder, .gguf, hub id or LLM)", generate)
            == "method 'draft_model' needs --draft-model (a model folder, .gguf, hub id or LLM)")
    assert in_flags("options['draft_vocab'] must be an integer >= 2", generate) == "--draft-vocab must be an integer >= 2"
    assert in_flags("draft_lookup must be in 0..ngram_max (4), got 9", generate) == "--draft-lookup must be in 0..--ngram-max (4), got 9"
    assert in_flags("unknown speculative method 'x'", generate) == "unknown speculative method 'x'"


def test_a_bad_choice_is_two_lines_with_the_choices_and_the_near_miss(capsys):
    for argv, wanted in ((["generate", "--dtype", "fp16"], "(did you mean 'bfloat16'?)"),
                         (["generate", "--draft-dtype", "flaot32"], "(did you mean 'float32'?)"),
                         (["generat"], "(did you mean 'generate'?)")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and wanted in err and "usage:" not in err and len(err.splitlines()) == 2, err
    err = _cli_error(capsys, ["cost", "--dtype", "float32,fp16"])  # (a comma-separated list: checked by cost itself)
    assert "choose from auto, gguf, float32, bfloat16, int8, int4 (did you mean 'bfloat16'?)" in err


def test_empty_and_non_utf8_prompts_are_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("the model loaded"))
    assert "the prompt is empty" in _cli_error(capsys, ["generate", ""])
    assert "the prompt is empty" in _cli_error(capsys, ["generate", "  \n"])
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what "$(cat latin1.txt)" reaches Python as
    assert "not UTF-8 text (byte 0xe9 at character 3)" in _cli_error(capsys, ["generate", bad])


def test_a_prompt_file_that_is_not_utf8_names_the_file_and_line(tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    err = _cli_error(capsys, ["compare", "--prompts", str(prompts)])
    assert f"{prompts}:2: not UTF-8 text (byte 0xe9" in err


def test_llm_generate_refuses_an_empty_prompt():
    with pytest.raises(ConfigError, match="empty prompt"):
        LLM(tiny_model(seed=0), tokenizer=_BosTokenizer()).generate("")


class _BosTokenizer:
    """Adds BOS (id 1) to every text: an empty string would still be a one-token prompt."""

    bos_token, eos_token_ids = "<s>", {2}

    def encode(self, text, add_special_tokens=True):
        return [1] * add_special_tokens + [3 + ord(c) % 20 for c in text]


def test_cli_unknown_prompt_set(capsys):
    assert "unknown" in _cli_error(capsys, ["compare", "--prompts", "nope"]).lower()


def test_missing_weights_and_corrupt_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2)))
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        LLM(model=str(tmp_path), tokenizer=object())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(model=str(tmp_path), tokenizer=object())
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="not a valid model config"):
        LLM(model=str(tmp_path), tokenizer=object())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        LLM(model=str(tmp_path), tokenizer=object())


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError):
        LLM(model=str(bad))


def test_draft_model_with_another_vocabulary():
    verifier = LLM(tiny_model(seed=0, vocab_size=32))
    draft = LLM(tiny_model(seed=1, vocab_size=48))
    with pytest.raises(ConfigError, match="vocabulary differs from the verifier"):
        verifier.generate([[1, 2]], SamplingParams(max_tokens=2), speculative=SpeculativeConfig("draft_model", 2, draft_model=draft))
    with pytest.raises(ConfigError, match="needs draft_model"):
        verifier.generate([[1, 2]], SamplingParams(max_tokens=2), speculative=SpeculativeConfig("draft_model", 2))


def test_prompt_longer_than_context():
    llm = LLM(tiny_model(max_position_embeddings=16))
    with pytest.raises(ContextLengthError, match="context is 16 tokens"):
        llm.generate([list(range(16))], SamplingParams(max_tokens=4))
    # a prompt that fits gets its budget clipped to the context instead of failing
    out = llm.generate([list(range(12))], SamplingParams(temperature=0, max_tokens=50))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_absurd_values_in_python_api():
    for bad in (dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_k=-5), dict(max_tokens=0)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    with pytest.raises(ConfigError):
        SpeculativeConfig("ngram", num_speculative_tokens=1000)
    with pytest.raises(ConfigError):
        SpeculativeConfig("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ConfigError):
        LLM(tiny_model()).generate([[40]], SamplingParams(max_tokens=1))  # id outside the vocabulary


def test_token_prompts_without_tokenizer_refuse_text():
    with pytest.raises(ConfigError, match="no tokenizer"):
        LLM(tiny_model()).generate("hello")


def test_model_state_is_untouched_after_an_error():
    llm = LLM(tiny_model())
    before = {k: v.clone() for k, v in llm.model.state_dict().items()}
    with pytest.raises(ContextLengthError):
        llm.generate([list(range(20)) * 20], SamplingParams(max_tokens=2))
    after = llm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_tiny_temperature_is_not_a_crash():
    out = LLM(tiny_model()).generate([[1, 2, 3]], SamplingParams(temperature=1e-40, max_tokens=5, seed=0))[0]
    greedy = LLM(tiny_model()).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.token_ids == greedy.token_ids


def test_weights_that_do_not_fit_the_config(tmp_path):
    from safetensors.torch import save_file

    cfg = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="do not match"):
        LLM(model=str(tmp_path), tokenizer=object())


def test_tune_skip_rejects_zero_confirm(capsys):
    assert "--confirm" in _cli_error(capsys, ["tune-skip", "--confirm", "0"])


def test_version_names_the_int8_paths(capsys):
    import pytest as _pytest

    from forerun.cli import main

    with _pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("forerun ") and "torch" in out and "int8 / int4:" in out
    assert any(line.startswith("kernels: ") and line.split()[1] in ("installed", "runtime-built", "none")
               for line in out.splitlines()), out


def test_prompts_of_the_wrong_type_name_what_is_accepted():
    from forerun.errors import ConfigError
    from forerun.llm import LLM
    from tests.tiny import tiny_model

    llm = LLM(tiny_model(seed=0))
    for bad in (123, [1.5, 2.0], [[1, 2], 3.0], {"a": 1}):
        with pytest.raises(ConfigError, match="prompts must be a string, a list of strings"):
            llm.generate(bad)


def test_an_unknown_method_is_refused_at_construction():
    from forerun.config import SpeculativeConfig
    from forerun.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown speculative method 'nosuch'.*ngram"):
        SpeculativeConfig(method="nosuch")


def test_a_context_cut_says_so():
    from forerun.config import SamplingParams
    from forerun.llm import LLM
    from tests.tiny import tiny_model

    llm = LLM(tiny_model(seed=0, max_position_embeddings=20))
    out = llm.generate([[1, 2, 3] * 5], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.finish_detail == "context" and len(out.token_ids) == 5
    full = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert full.finish_reason == "length" and full.finish_detail == "max_tokens"


def test_help_shows_defaults_and_bare_forerun_prints_it(capsys):
    from forerun.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "generate" in out and "compare" in out and "cost" in out
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    help_text = capsys.readouterr().out
    for shown in ("(default: 5)", "(default: 128)", "(default: 10)", "FORERUN_DATA_DIR"):
        assert shown in help_text, shown


def test_every_help_says_each_default_once(capsys):
    import re

    from forerun.cli import _subparser, build_parser

    parser = build_parser()
    commands = list(next(a for a in parser._actions if a.dest == "command").choices)
    for command in commands:
        text = " ".join(_subparser(parser, command).format_help().split())  # (help lines wrap)
        assert "(default: None)" not in text and "(default: False)" not in text, command
        for action in _subparser(parser, command)._actions:
            said = re.findall(r"\(default", action.help or "") + (["%"] if "%(default)" in (action.help or "") else [])
            assert len(said) <= 1, (command, action.dest)
    assert "(default: int4 on the CPU with the kernels, the fastest measured, which changes acceptance, never the output; else the verifier's)" in " ".join(
        _subparser(parser, "generate").format_help().split())


def test_methods_lists_every_method_with_a_line_on_each(capsys):
    from forerun.drafters import available_methods
    from forerun.methods import METHODS

    assert cli.main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(METHODS) and lines[0].split()[0] == "none"
    assert all(len(line.split()) > 4 for line in lines)  # a name and what it does
    assert available_methods() == sorted(set(METHODS) - {"none"})  # the registry builds exactly the listed ones


def test_serve_on_a_port_in_use_fails_before_the_model_loads(capsys, monkeypatch):
    import socket

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("the model loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _cli_error(capsys, ["serve", "--port", str(port)])
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err and "choose another --port" in err


def test_default_outputs_go_under_forerun_runs():
    from forerun.cli import build_parser

    assert build_parser().parse_args(["bench"]).out == "forerun-runs/bench"
    assert build_parser().parse_args(["cost"]).plot == "forerun-runs/cost.png"


def test_k_zero_says_speculation_is_off(capsys):
    from forerun.cli import build_parser
    from forerun.cli_args import configs

    args = build_parser().parse_args(["generate", "--k", "0", "--method", "ngram"])
    _, spec = configs(args)
    assert not spec.enabled and "--k 0 turns speculation off" in capsys.readouterr().err


def test_speedup_spread_helpers():
    from forerun.bench.spread import ratio_interval, verdict

    low, high = ratio_interval([1.0, 3.0, 2.0, 2.2], [1.0, 1.0, 1.0, 1.1])
    assert 1.0 <= low <= high <= 3.0
    assert verdict(low, high) == "faster" or low <= 1.0
    assert verdict(0.9, 1.1) == "within noise"


def test_doctests():
    import doctest

    from forerun import cli_args, errors

    assert doctest.testmod(cli_args).failed == 0 and doctest.testmod(errors).failed == 0
