"""model.* and data.*: what is trained (the project's decoder or a Hugging Face causal
LM) and on what tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.config.enums import DataKind, HFAttention, LoraBase, ModelKind, TextFormat, TokenDtype, TrainOn
from launcher.config.moe import MoEConfig


@dataclass
class LoraConfig:
    """model.lora.*: low-rank adapters (LoRA, Hu et al. 2021) on named projections; the base
    weights frozen. `make train ARGS="model=hf model.pretrained=DIR model.lora.rank=16"`."""

    rank: int = 0
    """Adapter rank r (0: off, every weight trains). Each targeted linear W (out x in) gets
    A (r x in) and B (out x r), B zero at the start: r x (in + out) trainable parameters
    instead of in x out, so gradients and optimizer states shrink about in/(2r)-fold
    (Llama-3-8B, r=16, every projection: 42M trainable of 8.0B). Higher r fits more,
    costs more; 8-64 is usual."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's lora_alpha): with alpha fixed,
    a higher rank does not need another learning rate."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout); 0 keeps one activation fewer."""
    targets: Optional[list] = None
    """Projection names to adapt, matched against the last part of each linear's name inside
    the decoder layers (q_proj, v_proj, ... for model=hf; wq, wk, wv, wo, w1, w2, w3 for the
    project's decoder). null: every linear inside the decoder layers (PEFT's all-linear: not
    the output head). A name that matches no module is refused at launch."""
    base_dtype: LoraBase = LoraBase.auto
    """How the frozen base weights are held. auto: in the compute dtype (bf16 under
    precision=bf16: 2 bytes a parameter instead of the 4 of an fp32 master copy, which a
    frozen weight does not need; fp32 under fp32). nf4: 4-bit NormalFloat (QLoRA,
    torchao's NF4 tensor: about 0.52 bytes a parameter, dequantized block by block in each
    forward: slower matmuls), the targeted linears only (embeddings, norms and the head
    stay in the compute dtype); ddp only for now."""
    base_digest: Optional[str] = None
    """Set by the launcher: the sha256 of model.pretrained's files. A checkpoint records it;
    a resume onto another base is refused."""


@dataclass
class ModelConfig:
    """The project's Llama-style decoder (launcher/models/gpt.py)."""

    name: str = "gpt_tiny"
    vocab_size: int = 256
    """Embedding rows. Must cover the data's vocabulary."""
    dim: int = 128
    """Hidden size. Cost grows with dim^2 per token for parameters and FLOPs."""
    n_layers: int = 4
    n_heads: int = 4
    """Attention heads; dim must divide by it unless model.head_dim is set."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (null = n_heads). Fewer heads shrink the
    KV projections and cache; must divide n_heads."""
    head_dim: Optional[int] = None
    """Each head's width (null = dim / n_heads). Set apart from it, q projects dim to n_heads x
    head_dim (Qwen3-30B-A3B: 2048 to 32 x 128): more attention per parameter of the residual."""
    qk_norm: bool = False
    """An RMSNorm over each head's q and k (weights of head_dim) before rotary (Qwen3): steadier
    attention logits; 2 x head_dim parameters per block. Not under parallel.tp."""
    attn_bias: bool = False
    """Biases on the q, k and v projections (not o: Qwen2, Qwen1.5-MoE). Not under parallel.tp."""
    ffn_dim: Optional[int] = None
    """SwiGLU hidden size (null = 8/3 * dim rounded up to multiple_of)."""
    multiple_of: int = 64
    """Round ffn_dim up to this (tensor-core friendly shapes)."""
    max_seq_len: int = 512
    """Longest sequence the rotary table covers; train.seq_len must not exceed it."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    """Share the input embedding with the output head: saves vocab*dim parameters, which
    matters for small models; large models usually untie."""
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)
    """A mixture of experts in place of the feed-forward (model.moe.experts > 0): see MoEConfig."""

    # ---- model=hf (conf/model/hf.yaml): a transformers causal LM from local files only.
    # The fields above shape the project's decoder; with kind=hf the shape comes from the
    # Hugging Face config and they are not used.
    kind: ModelKind = ModelKind.gpt
    """gpt: the project's decoder, shaped by the fields above. hf: any causal LM that
    transformers (the optional `hf` extra) builds offline from `config` or `pretrained`;
    nothing is fetched from a hub (HF_HUB_OFFLINE=1 on the launch side and the ranks).
    Tensor and pipeline parallel need a Llama-family layout (launcher/models/hf.py)."""
    config: Optional[str] = None
    """hf: a config.json (or the folder holding one): AutoModelForCausalLM.from_config,
    random init from train.seed, the same on every rank. Cheap to try shapes; it starts
    from nothing."""
    pretrained: Optional[str] = None
    """hf: a local folder with config.json and *.safetensors weights (save_pretrained's
    layout): the structure from its config.json, each rank reading only the tensor slices
    it holds, in fp32 (the master copy; precision.name decides the compute dtype); names
    must match the model's own (no key conversion: MoE folders that need transformers'
    conversion mapping are refused). Exactly one of config/pretrained.
    gpt (the project's decoder): a Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE, Llama or Mistral folder read into
    the decoder the fields above shape, which must be the folder's (checked against its
    config.json at launch); each rank reads only its experts and rows (models/hf_adapter.py)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters over a frozen base (model.lora.rank > 0): see LoraConfig."""
    attn_implementation: HFAttention = HFAttention.sdpa
    """hf: sdpa (torch's fused attention; the causal mask is implicit, no mask tensor)
    or eager (transformers' matmul-softmax reference: slower, materialises seq^2 scores)."""


@dataclass
class DataConfig:
    name: DataKind = DataKind.synthetic
    """synthetic: an order-k Markov source generated from a seed, with a known entropy
    rate (the loss floor). memmap: a flat token file (.bin) as nanoGPT writes it;
    scripts/prepare_data.py makes one from a local text file. hf_text: local text files
    tokenized once into the shared cache. chat: local conversations (`messages`, or
    `prompt`/`completion`) rendered with a chat template, tokenized once with a loss mask,
    packed into windows of whole samples (docs/data.md)."""
    vocab_size: int = 256
    """synthetic: alphabet of the source. memmap: the largest token id + 1 in the file
    (256 for scripts/prepare_data.py's byte-level encoding). hf_text: unused (the
    tokenizer's vocabulary is checked against the model's embedding)."""
    order: int = 2
    """synthetic: the next token depends on this many previous tokens. Higher orders are
    harder to learn in a short run."""
    context_bits: int = 2
    """synthetic: the context is the previous token plus the low `context_bits` bits of
    each of the order-1 tokens before it: vocab_size * 2^(context_bits * (order-1))
    contexts, each with its own next-token distribution. More contexts = more to learn."""
    temperature: float = 1.0
    """synthetic: in each context the i-th likeliest token has probability ∝ exp(-i /
    temperature). 1.0 gives an entropy rate of 1.04 nats; lower is easier to predict."""
    seed: int = 0
    """synthetic: the source's seed (its transition tables). Different from train.seed."""
    path: Optional[str] = None
    """memmap: a token file (nanoGPT's train.bin), a folder of *.bin shards or one `make
    data` prepared (index.json), or a glob: one stream, windows cut inside each file.
    Opening many shards reads the index (or stats the files) only."""
    dtype: TokenDtype = TokenDtype.uint16
    """memmap: token width in the file (uint16 covers vocabularies up to 65536)."""
    val_path: Optional[str] = None
    """memmap: a token file of its own (same dtype) for train.eval_every's validation."""
    val_fraction: float = 0.0
    """memmap, hf_text, chat: the last fraction of the token windows held out from training for
    validation (0: none; up to 0.5). Changes which windows train: set it from the start."""
    sources: Any = None
    """memmap: a weighted mixture instead of data.path, a list of {name, path, weight}
    (val_path optional) or Megatron's '30 path_a 70 path_b' (names: the files' stems).
    Each path is anything data.path takes. Weights are normalised; global sample i goes
    to a source by a fixed interleave (every prefix within one sample of the weights), so
    resume and a new world size keep the blend; a source that runs out starts a fresh
    epoch order (logged). metrics.jsonl and W&B get data/<name>/tokens."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank (null: 2 on CUDA, 0 on CPU where the cores
    are busy with the ranks). Workers hide data time but cost CPU and memory."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (only with workers)."""
    pin_memory: bool = True
    """Page-locked host buffers on CUDA for faster, asynchronous copies (ignored on CPU)."""
    files: Any = None
    """hf_text, chat: a glob or a list of globs of local files (`'corpus/*.jsonl'`, `[a.parquet,
    'b/*.parquet']`); relative to the directory the launcher runs in. All files must have
    one format. Documents are tokenized once, on the launch side, before any rank starts
    (`make data` alone, or `make train`), into the shared cache (data.cache_dir)."""
    format: TextFormat = TextFormat.auto
    """hf_text, chat: json (JSON lines, one document or conversation per line), parquet,
    text (hf_text: one document per line) or auto: from the files' extension (.jsonl/.json,
    .parquet, .txt/.text)."""
    text_field: str = "text"
    """hf_text: the column holding each document's text (plain text files have only
    `text`). A missing field is refused before launch, naming the fields there are."""
    tokenizer: str = "byte"
    """hf_text: `byte`: the project's byte-level encoding (UTF-8 bytes, vocabulary 256, as
    scripts/prepare_data.py), end of document = 255, a byte UTF-8 text never contains, so
    the vocabulary stays 256; or a local folder AutoTokenizer loads offline (tokenizer.json,
    tokenizer_config.json...; a model folder with them works too); its EOS token ends each
    document. Its vocabulary must fit the model's embedding. data=chat: a folder (its
    chat_template renders the conversations, unless data.chat_template names one)."""
    num_proc: Optional[int] = None
    """hf_text, chat: processes that tokenize (null: the cores this process may use, its CPU
    affinity). Work units are files and newline-aligned pieces of large ones (parquet: row
    groups), so one big file uses every process too."""
    shard_mb: int = 256
    """hf_text, chat: MiB of input per work unit; each unit writes one shard of the prepared data.
    Smaller: finer progress and a relaunch redoes less; larger: fewer files."""
    document_masking: bool = False
    """Packed windows whose samples (data=chat) or documents (hf_text: split at the
    tokenizer's end-of-document token) do not see each other: positions restart at each
    sample and attention is block-causal within it. Costs a mask (or FlexAttention's block
    mask) per micro-batch; without it a packed window attends across its samples, as plain
    pretraining does. Not with parallel.cp > 1."""
    cache_dir: Optional[str] = None
    """hf_text, chat: the shared cache of prepared data, one directory per content key
    (files' sha256, format, fields, tokenizer; chat: the template's text and train_on): every run and sweep point with the same inputs reads
    the same one. null: $LAUNCHER_DATA_CACHE, else ~/.cache/launcher/data. Several nodes or
    a Slurm/Kubernetes job read it: a shared folder."""
    chat_template: Optional[str] = None
    """chat: a Jinja template file (a `chat_template.jinja`, as transformers writes one)
    rendering the conversations instead of the tokenizer folder's own chat_template (null:
    the tokenizer's). A template that marks the assistant's tokens ({% generation %}) gets
    its mask from transformers; any other is rendered prefix by prefix (refused when a
    longer prefix changes the tokens of a shorter one)."""
    train_on: TrainOn = TrainOn.assistant
    """chat: the tokens that count in the loss. assistant: every assistant turn (the usual
    supervised fine-tune); completion: the last assistant turn, or a prompt/completion
    row's completion (earlier turns are context only); all: every token, the prompts too
    (more signal per sample, but the model also learns to write the users' side)."""
    messages_field: str = "messages"
    """chat: the column holding a conversation, a list of {role, content} (roles system,
    user, assistant, tool). Rows without it need `prompt` and `completion` (strings: one
    user and one assistant turn; or lists of messages, TRL's conversational form)."""


SOURCE_KEYS: dict[str, tuple[DataKind, ...]] = {
    **{k: (DataKind.synthetic,) for k in ("order", "context_bits", "temperature", "seed")},
    **{k: (DataKind.memmap,) for k in ("path", "dtype")},
    "vocab_size": (DataKind.synthetic, DataKind.memmap),
    "text_field": (DataKind.hf_text,),
    **{
        k: (DataKind.hf_text, DataKind.chat)
        for k in ("files", "format", "tokenizer", "num_proc", "shard_mb", "cache_dir", "document_masking")
    },
    **{k: (DataKind.chat,) for k in ("chat_template", "train_on", "messages_field")},
}
"""The data.* keys only some sources read (val_path, val_fraction and sources are checked with
train.eval_every's held-out data). A run that sets one its data= does not read is refused
(launcher/launch/checks/asked.py): `data.files=...` without data=hf_text would otherwise train on
synthetic data, without a word."""
