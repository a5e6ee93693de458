"""data=chat: conversations rendered into tokens and a loss mask (against transformers'
own apply_chat_template), prepared into the shared cache, packed into windows of whole
samples, read by the ranks through micro_batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from chat_data import TEMPLATE, chat_tokenizer, rows

from launcher.config import TrainOn
from launcher.data.chat import COUNTS, START, RowError, Template, conversation, render
from launcher.data.inputs import load_tokenizer
from launcher.data.packing import Packed, pack, restart_positions
from launcher.data.read import IGNORE, micro_batch
from launcher.launch.compose import compose_config

PLAIN = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same rendering without the marks: most real templates (Llama 3's) mark nothing."""
TRL_ROWS = [  # TRL's prompt-completion forms: strings, and lists of messages
    {"prompt": "What is 2 + 3 ?", "completion": "2 + 3 = 5"},
    {
        "prompt": [
            {"role": "system", "content": "Answer with the result only ."},
            {"role": "user", "content": "What is 7 - 4 ?"},
        ],
        "completion": [{"role": "assistant", "content": "3"}],
    },
]


def hf():
    return load_tokenizer(str(chat_tokenizer())).tok


def template(text: str = TEMPLATE) -> Template:
    return Template(text, ("data.chat_template", "t.jinja"))


def test_tokens_and_mask_equal_transformers_and_the_prefix_method_agrees():
    """For rows rendered with a template that marks generation, the tokens and the mask
    are transformers' apply_chat_template(..., return_assistant_tokens_mask=True); the
    prefix method gives the same mask on the same template and on its twin without marks."""
    tok = hf()
    for row in rows(60, seed=3) + TRL_ROWS:
        messages, turns = conversation(row, "messages", TrainOn.assistant)
        ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert sum(ref["assistant_masks"]) > 0
        for t, by_prefix in ((template(), None), (template(), True), (template(PLAIN), None)):
            ids, mask = render(tok, t, messages, turns, TrainOn.assistant, by_prefix=by_prefix)
            assert ids.tolist() == ref["input_ids"]
            assert (mask & COUNTS).tolist() == ref["assistant_masks"], (row, by_prefix)
            assert mask[0] == START and not (mask[1:] & START).any()


def test_train_on_completion_and_all():
    tok = hf()
    two = {
        "messages": [
            {"role": "user", "content": "What is 1 + 1 ?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "And now What is 2 + 2 ?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    ids, assistant = render(tok, template(), *conversation(two, "messages", TrainOn.assistant), TrainOn.assistant)
    words = tok.convert_ids_to_tokens(ids.tolist())
    assert [w for w, m in zip(words, assistant) if m & COUNTS] == ["2", "<|end|>", "4", "<|end|>"]
    for t in (template(), template(PLAIN)):
        _, last = render(tok, t, *conversation(two, "messages", TrainOn.completion), TrainOn.completion)
        assert [w for w, m in zip(words, last) if m & COUNTS] == ["4", "<|end|>"]
    _, every = render(tok, template(), *conversation(two, "messages", TrainOn.all), TrainOn.all)
    assert every.tolist() == [START] + [COUNTS] * (len(ids) - 1)
    # a prompt/completion row's completion: all of it, whatever the prompt holds
    _, completion = render(
        tok, template(), *conversation(TRL_ROWS[1], "messages", TrainOn.completion), TrainOn.completion
    )
    assert (completion & COUNTS).sum() == 2  # "3" and its <|end|>


@pytest.mark.parametrize(
    "row,train_on,words",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, TrainOn.assistant, ["no assistant turn", "train_on=all"]),
        ({"messages": [{"role": "robot", "content": "hi"}]}, TrainOn.all, ["message 1", "'robot'", "system, user"]),
        ({"text": "hi"}, TrainOn.assistant, ["no `messages` field", "`prompt` and `completion`"]),
        ({"prompt": "hi", "completion": 3}, TrainOn.assistant, ["`completion` is a int"]),
        ([1, 2], TrainOn.assistant, ["not a JSON object"]),
    ],
)
def test_rows_refused(row, train_on, words):
    with pytest.raises(RowError) as err:
        conversation(row, "messages", train_on)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_template_that_rewrites_earlier_turns_is_refused_by_the_prefix_method():
    """A template that shows only the last assistant turn's content (as those that drop old
    reasoning do): the rendering through turn 1 is no prefix of the whole."""
    rewriting = PLAIN.replace(
        "{{ message['content'] }}<|end|>{% else %}",
        "{% if loop.last %}{{ message['content'] }}{% endif %}<|end|>{% else %}",
    )
    two = rows(40, seed=1)
    row = next(r for r in two if len(r["messages"]) >= 4)
    with pytest.raises(RowError) as err:
        render(hf(), template(rewriting), *conversation(row, "messages", TrainOn.assistant), TrainOn.assistant)
    assert err.value.key == ("data.chat_template", "t.jinja") and "do not extend" in str(err.value)


def test_pack_keeps_samples_whole_and_cuts_the_long_one():
    start, real = pack(np.array([3, 4, 2, 10, 1, 5]), 6)
    assert start.tolist() == [0, 3, 9, 19] and real.tolist() == [3, 6, 6, 6]
    assert restart_positions(np.array([1, 0, 0, 1, 0, 1], dtype=bool)).tolist() == [0, 1, 2, 0, 1, 0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The preparation of 300 rows (one of them longer than the windows below), through the
    real pool into a cache: (folder, rows, the config)."""
    from launcher.data.cache import prepare

    tmp = tmp_path_factory.mktemp("chat")
    data = rows(300, seed=5)
    data[7] = {
        "messages": [{"role": "user", "content": " ".join(["red"] * 80)}, {"role": "assistant", "content": "80"}]
    }
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    cfg, _, _ = compose_config(
        [
            "data=chat",
            f"data.files={path}",
            f"data.tokenizer={chat_tokenizer()}",
            f"data.cache_dir={tmp / 'cache'}",
            "data.num_proc=2",
        ]
    )
    got = prepare(cfg, unit_bytes=8 << 10)  # several units and shards
    assert len(got.index["shards"]) > 2 and got.index["documents"] == 300
    return got.dir, data, cfg


def test_the_prepared_shards_hold_transformers_tokens_and_masks(prepared):
    folder, data, _ = prepared
    index = json.loads((folder / "index.json").read_text())
    tok = hf()
    tokens = np.concatenate([np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"]])
    masks = np.concatenate([np.fromfile(folder / s["mask"], dtype=np.uint8) for s in index["shards"]])
    lengths = np.concatenate([np.fromfile(folder / s["lengths"], dtype=np.uint32) for s in index["shards"]])
    at = 0
    for row, n in zip(data, lengths):
        ref = tok.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert tokens[at : at + n].tolist() == ref["input_ids"]
        assert (masks[at : at + n] & COUNTS).tolist() == ref["assistant_masks"]
        at += n
    assert at == len(tokens) == index["tokens"] and index["counted"] == int((masks & COUNTS).sum())
    assert index["kind"] == "chat" and index["train_on"] == "assistant" and len(index["template_sha256"]) == 64


def test_the_launch_says_how_full_and_how_many_are_cut(prepared, tmp_path):
    """make train's lines: the prepared data reused, its windows at train.seq_len, the one
    conversation longer than a window; RUN_DIR/data/chat.json names the folder."""
    import dataclasses

    from launcher.data.prepare import prepare_cache

    folder, _, cfg = prepared
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=64))
    lines = prepare_cache(cfg, tmp_path).splitlines()
    packed = Packed(folder, 65)
    assert lines[0].startswith("data: 300 conversations, ") and f"{packed.windows:,} windows of 64 packed" in lines[0]
    assert "reused" in lines[0] and f"{packed.efficiency():.1%} full" in lines[0]
    assert lines[1] == (
        "data: 1 of 300 conversations are longer than train.seq_len + 1 = 65 tokens: each is cut to "
        "one window (its tail is not trained)"
    )
    assert json.loads((tmp_path / "data" / "chat.json").read_text())["dir"] == str(folder)


def test_windows_pad_restart_positions_and_are_the_same_every_time(prepared):
    folder, data, _ = prepared
    size = 65
    packed, again = Packed(folder, size), Packed(folder, size)
    assert packed.truncated == 1 and packed.samples == 300 and 0.5 < packed.efficiency() <= 1
    assert (packed.start == again.start).all() and (packed.real == again.real).all()
    seen = 0
    for w in range(packed.windows):
        x = packed.window(w, document_masking=True)
        plain = packed.window(w, document_masking=False)
        real = int(packed.real[w])
        assert x.shape == (3, size) and (x[:2] == plain[:2]).all() and plain[2].tolist() == list(range(size))
        assert (x[0, real:] == packed.pad).all() and not x[1, real:].any()  # padding counts in no loss
        starts = np.flatnonzero(x[2] == 0)
        assert starts[0] == 0 and (real == size or real in starts)  # a sample starts at each 0, the padding too
        seen += real
    assert seen == sum(
        min(n, size)
        for n in np.concatenate(
            [
                np.fromfile(folder / s["lengths"], dtype=np.uint32)
                for s in json.loads((folder / "index.json").read_text())["shards"]
            ]
        )
    )


def test_chat_windows_follow_the_epoch_order_and_resume_anywhere(prepared):
    """Each epoch visits every window once, in an order of its own; the loader started at
    samples_seen yields what the uninterrupted one yields from there (any world size)."""
    from launcher.data.read import ChatFile, StepSampler

    folder, _, _ = prepared
    data = ChatFile(str(folder), 64, seed=3, val_fraction=0.1, document_masking=True)
    n = data.windows
    assert data.held_out == int(np.ceil(0.1 * data.packed.windows)) and n + data.held_out == data.packed.windows
    first = [data._window(i) for i in range(n)]
    second = [data._window(n + i) for i in range(n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second
    batches = [b for _, b in zip(range(6), StepSampler(0, 8, 0, 1, 4))]
    resumed = next(iter(StepSampler(16, 8, 1, 2, 4)))  # rank 1 of 2, resumed after 2 steps of 8
    assert resumed == batches[5]
    other = ChatFile(str(folder), 64, seed=3, val_fraction=0.1, document_masking=True)  # another process, later
    assert torch.equal(other.__getitems__(resumed), data.__getitems__(batches[5]))
    assert other.fingerprint() == data.fingerprint()
    assert data.real_tokens(0, 2 * n) == 2 * int(data.packed.real[:n].sum())


def test_micro_batch():
    tokens = torch.arange(10).reshape(2, 5)
    x, y = micro_batch(tokens)
    assert torch.equal(x, tokens[:, :-1]) and torch.equal(y, tokens[:, 1:])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    batch = torch.stack([tokens, mask, positions], dim=1)
    x, y, p = micro_batch(batch)
    assert torch.equal(x, tokens[:, :-1]) and torch.equal(p, positions[:, :-1])
    assert y.tolist() == [[IGNORE, 2, 3, IGNORE], [6, IGNORE, IGNORE, IGNORE]]
    assert len(micro_batch(batch, document_masking=False)) == 2


def test_hf_text_documents_restart_positions_after_eos(tmp_path):
    from launcher.config import DataConfig
    from launcher.data.read import TokenFile, write_tokens

    write_tokens(np.array([5, 6, 9, 7, 9, 8, 8, 8, 9]), tmp_path / "t.bin")
    data = TokenFile(DataConfig(path=str(tmp_path / "t.bin")), 8, seed=0, eos_id=9)
    window = data.window(0)
    assert window[0].tolist() == [5, 6, 9, 7, 9, 8, 8, 8, 9] and window[1].tolist() == [1] * 9
    assert window[2].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_no_template_and_a_template_that_does_not_render_are_refused(tmp_path):
    from corpus import make_tokenizer

    from launcher.config import ConfigError, DataConfig
    from launcher.data.chat import load_template

    bare = make_tokenizer(tmp_path / "bare", ["a", "b"])
    with pytest.raises(ConfigError, match="has no chat template"):
        load_template(DataConfig(tokenizer=str(bare)), load_tokenizer(str(bare)).tok)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")
    with pytest.raises(ConfigError, match="does not render a user and an assistant turn"):
        load_template(DataConfig(tokenizer=str(chat_tokenizer()), chat_template=str(broken)), hf())


def test_parquet_rows_prepare_as_json_lines_do_and_a_bad_row_is_named(tmp_path):
    """The same conversations as parquet (a list of structs) give the same tokens and mask;
    a bad row is named by its 1-based row number across row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.config import ConfigError
    from launcher.data.cache import prepare, read_tokens

    data = rows(40, seed=9)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    pq.write_table(pa.table({"messages": [r["messages"] for r in data]}), tmp_path / "a.parquet", row_group_size=16)
    made = {}
    for name, files in (("json", tmp_path / "j" / "a.jsonl"), ("parquet", tmp_path / "a.parquet")):
        cfg, _, _ = compose_config(
            [
                "data=chat",
                f"data.files={files}",
                f"data.tokenizer={chat_tokenizer()}",
                f"data.cache_dir={tmp_path / 'cache'}",
                "data.num_proc=1",
            ]
        )
        got = prepare(cfg)
        masks = np.concatenate([np.fromfile(got.dir / s["mask"], dtype=np.uint8) for s in got.index["shards"]])
        made[name] = (read_tokens(got.dir)[0], masks)
    assert (made["json"][0] == made["parquet"][0]).all() and (made["json"][1] == made["parquet"][1]).all()
    bad = [r["messages"] for r in data]
    bad[33] = [{"role": "user", "content": "no answer"}]
    pq.write_table(pa.table({"messages": bad}), tmp_path / "bad.parquet", row_group_size=16)
    cfg, _, _ = compose_config(
        [
            "data=chat",
            f"data.files={tmp_path / 'bad.parquet'}",
            f"data.tokenizer={chat_tokenizer()}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.num_proc=1",
        ]
    )
    with pytest.raises(ConfigError, match=r"bad.parquet: row 34: has no assistant turn"):
        prepare(cfg)


def test_a_reply_whose_first_character_merges_with_the_prompt_is_masked_not_refused():
    """ChatML without generation marks under a pre-tokenizer that merges newlines (Qwen's
    `\\s*[\\r\\n]+`): the prompt ends "assistant\\n", a reply starting "\\n" makes one "\\n\\n"
    token across the boundary, so the prompt's tokens are no prefix of the whole's. The
    renderings are prefixes as text: the reply's tokens are those starting inside it."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from launcher.data.chat import prefix_mask

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "\n", "\n\n", "hi", "there", "ask", " "]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s*[\r\n]+|<\|im_start\|>|<\|im_end\|>|\w+| "), "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    chatml = Template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        ("data.chat_template", "x"),
    )
    messages = [{"role": "user", "content": "ask"}, {"role": "assistant", "content": "\nhi there"}]
    ids, counts = prefix_mask(tok, chatml, messages, [1])
    counted = [words[i] for i, c in zip(ids, counts) if c]
    assert "\n\n" in [words[i] for i in ids]  # the merged token straddles the prompt and the reply
    assert counted == ["hi", " ", "there", "<|im_end|>", "\n"], counted
