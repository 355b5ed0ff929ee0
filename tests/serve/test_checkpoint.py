"""``serve --model FOLDER``: a checkpoint folder (``save_pretrained`` of a tiny model and of a word-level
tokenizer built here, no network) loads on the CPU without accelerate, with the folder's weights, its
tokenizer, its chat template and the generation config's EOS ids; a folder without a chat template refuses
chat rendering by name; a name that is neither a preset nor a folder is refused with both listed."""

import re

import pytest
import torch

from unimem_compile.cli import main

from unimem_compile.hf.models import build_model
from unimem_compile.serve.server import ServeOptions, load_model
from unimem_compile.serve.text import ChatTemplateMissing, HFCodec

WORDS = ["<pad>", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "on", "mat", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tokenizer(chat_template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model("kimi-linear-tiny")
    model.generation_config.eos_token_id = [2, 7]  # two ids: the server ends a reply at either
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    _tokenizer(TEMPLATE).save_pretrained(path)
    return path, model


def test_a_checkpoint_folder_loads_its_weights_tokenizer_and_eos_ids(folder):
    path, saved = folder
    model, codec = load_model(ServeOptions(model=str(path), device="cpu"))
    assert type(model) is type(saved) and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the CPU default
    for (name, a), (_, b) in zip(saved.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert isinstance(codec, HFCodec) and codec.vocab_size == len(WORDS)
    assert codec.eos_token_ids == frozenset({2, 7})
    ids = codec.encode("hello world the cat")
    assert ids == [3, 4, 5, 6] and codec.decode(ids + [2]) == "hello world the cat"  # specials skipped
    assert codec.chat_ids([{"role": "user", "content": "the cat sat"}]) == [10, 5, 6, 7, 11]
    assert ServeOptions(model=str(path) + "/").name == path.name


def test_a_folder_without_chat_template_refuses_chat_only(folder, tmp_path):
    path, saved = folder
    saved.save_pretrained(tmp_path)
    _tokenizer(None).save_pretrained(tmp_path)
    _, codec = load_model(ServeOptions(model=str(tmp_path), device="cpu"))
    assert codec.encode("on the mat") == [8, 5, 9]
    with pytest.raises(ChatTemplateMissing, match="no chat template; use /v1/completions"):
        codec.chat_ids([{"role": "user", "content": "hello"}])


def test_a_name_neither_preset_nor_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'.*nowhere' is neither a preset \(.*kimi-linear-tiny.*\) nor a checkpoint"):
        load_model(ServeOptions(model=str(tmp_path / "nowhere"), device="cpu"))


def test_serve_refuses_a_missing_folder_before_listening(tmp_path, capsys, monkeypatch):
    """Exit status 2 at once, as for the other bad options; the server used to come up and answer /health
    with "failed" until stopped."""
    import unimem_compile.serve.server as server

    def started(options):
        raise AssertionError(f"the server was started for --model {options.model!r}")

    monkeypatch.setattr(server, "serve", started)
    assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--model '.*nowhere' is neither a preset \(.*kimi-linear-tiny.*\) nor a checkpoint folder", err)


@pytest.mark.parametrize("option, message", [
    (["--kv-dtype", "fp8"], r"--kv-dtype: kv_dtype 'fp8' does not name a torch dtype \(fp8 is spelled 'fp8_e4m3'\)"),
    (["--kv-dtype", "float8_e5m2"], r"--kv-dtype 'float8_e5m2' is float8_e5m2, which the MLA ops cannot store; "
                                    r"accepted: bfloat16, float16, float32, float8_e4m3fn, float8_e4m3fnuz"),
    (["--backend", "inductr"], r"--backend 'inductr' is not a torch.compile backend; known: .*aot_eager.*inductor"),
    (["--port", "65536"], r"--port must be in \[0, 65535\] \(0: any free port\), got 65536"),
    (["--port", "-1"], r"--port must be in \[0, 65535\] \(0: any free port\), got -1"),
    (["--shutdown-timeout", "-1"], r"--shutdown-timeout must be a finite number of seconds >= 0, got -1"),
    (["--host", "bad host"], r"--host 'bad host' is not an address this machine can listen on \(.+\)"),
    (["--shutdown-timeout", "nan"], r"--shutdown-timeout must be a finite number of seconds >= 0, got nan"),
])
def test_serve_refuses_a_bad_kv_dtype_or_backend_before_listening(option, message, capsys, monkeypatch):
    """Exit status 2 and one line, as for --model: both used to start a server whose /health answered
    "failed" with the compile error until it was stopped (and it then exited 1)."""
    import unimem_compile.serve.server as server

    def started(options):
        raise AssertionError(f"the server was started with {option}")

    monkeypatch.setattr(server, "serve", started)
    assert main(["serve", "--model", "kimi-linear-tiny", *option]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1


def test_serve_refuses_device_cuda_without_cuda_before_listening(capsys, monkeypatch):
    """As demo does: the server used to come up and answer /health "failed" with torch's "Torch not compiled
    with CUDA enabled" until stopped (then exit status 1)."""
    import torch

    import unimem_compile.serve.server as server

    def started(options):
        raise AssertionError("the server was started with --device cuda and no CUDA")

    monkeypatch.setattr(server, "serve", started)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--model", "kimi-linear-tiny", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "unimem-compile serve: --device cuda but CUDA is not available\n"
