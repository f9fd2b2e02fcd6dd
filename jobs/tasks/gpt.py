"""A small nanoGPT-style language model on byte tokens, as an mgpu Task.

Decoder-only transformer: token + position embeddings, pre-LayerNorm blocks of causal
self-attention and MLP, an output head tied to the token embedding. The data is a token file from
`jobs/make_tokens.py`, cut into fixed windows; the default one is made from the installed Python's
standard library on first use, so nothing is downloaded.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from jobs.make_tokens import TokenError, make_stdlib_tokens, read_meta, write_shards
from mgpu.data.stream import ShardedStream, StreamError
from mgpu.data.stream import TokenWindows as StreamWindows
from mgpu.train.task import Task, TaskError

EVAL_FRACTION = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: fewer parameters, and trains better at this size
        self.apply(self._init)
        # GPT-2: scale the projections into the residual stream so its variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, time] -> next-token logits [batch, time, vocab]."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.block_size}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TokenWindows(Dataset):
    """Windows `first..first+count` of `block_size + 1` tokens; window i starts at token i * block_size,
    so consecutive windows share one token and every token but the first is a target exactly once."""

    def __init__(self, path: Path, dtype: str, block_size: int, first: int, count: int) -> None:
        self.path, self.dtype, self.block_size, self.first, self.count = path, dtype, block_size, first, count
        self._tokens: np.memmap | None = None  # opened lazily: DataLoader workers each open their own

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(index)
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = (self.first + index) * self.block_size
        return torch.from_numpy(self._tokens[start:start + self.block_size + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


class GptTask(Task):
    def __init__(self, tokens: str | None = None, stdlib_tokens: str = "runs/data/stdlib.bin", block_size: int = 128,
                 n_layer: int = 4, n_head: int = 4, n_embd: int = 128, dropout: float = 0.1, stream: bool = False,
                 shards: int = 8, shuffle_buffer: int = 256, interleave: int = 8) -> None:
        """`tokens`: a file from jobs/make_tokens.py; None: the stdlib corpus, made at `stdlib_tokens` if missing.
        `stream`: train on the same windows read as `shards` token files through mgpu.data.stream.ShardedStream
        (shard order per epoch, `interleave` shards read at once, a shuffle buffer of `shuffle_buffer` windows;
        no __len__) instead of a
        map-style dataset with a global permutation per epoch."""
        if n_embd % n_head:
            raise TaskError(f"task.args: n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.stream, self.shards, self.shuffle_buffer, self.interleave = stream, shards, shuffle_buffer, interleave
        self.path = Path(tokens if tokens is not None else stdlib_tokens)
        self.block_size, self.n_layer, self.n_head, self.n_embd, self.dropout = \
            block_size, n_layer, n_head, n_embd, dropout
        try:
            if tokens is None and not self.path.is_file():
                make_stdlib_tokens(self.path)  # atomic renames: ranks doing it at once are safe
            self.meta = read_meta(self.path)
        except TokenError as error:
            raise TaskError(f"task.args.tokens: {error}") from None
        windows = (self.meta["num_tokens"] - 1) // block_size
        self.n_eval = max(1, int(windows * EVAL_FRACTION))
        self.n_train = windows - self.n_eval
        if self.n_train < 1:
            raise TaskError(f"task.args.tokens: {self.path} has {self.meta['num_tokens']} tokens, too few for "
                            f"2 windows of block_size={block_size} + 1: use a larger file or a smaller block_size")

    def build_model(self) -> nn.Module:
        return GPT(self.meta["vocab_size"], self.block_size, self.n_layer, self.n_head, self.n_embd, self.dropout)

    def train_dataset(self) -> TokenWindows | ShardedStream:
        if not self.stream:
            return TokenWindows(self.path, self.meta["dtype"], self.block_size, 0, self.n_train)
        out = self.path.with_name(f"{self.path.stem}-shards-b{self.block_size}-n{self.shards}")
        try:
            files = write_shards(self.path, out, self.shards, self.block_size, self.n_train)
            return ShardedStream(files, StreamWindows(self.block_size, self.meta["dtype"]),
                                 shuffle_buffer=self.shuffle_buffer, interleave=self.interleave)
        except (TokenError, StreamError) as error:
            raise TaskError(f"task.args (stream): {error}") from None

    def eval_dataset(self) -> TokenWindows:
        return TokenWindows(self.path, self.meta["dtype"], self.block_size, self.n_train, self.n_eval)

    def tokens_per_sample(self) -> int:
        return self.block_size

    def _logits_and_targets(self, model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model(windows[:, :-1]), windows[:, 1:]

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits, targets = self._logits_and_targets(model, batch)
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)

    def metrics(self, model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, targets = self._logits_and_targets(model, batch)
        return {"loss": F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1),
                "accuracy": (logits.argmax(dim=-1) == targets).float().mean(dim=1)}
