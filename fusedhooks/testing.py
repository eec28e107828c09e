"""A GPT-2-small-sized model in plain torch, synthetic data and a training step, for tests and benchmarks; and a
count of the Python calls fusedhooks makes (`python_calls`).

`GPT2Config()` is GPT-2 small (124M parameters: 12 layers, 12 heads, d_model 768, vocabulary 50257, context
1024, tied input/output embeddings, LayerNorm, GELU MLP); `GPT2Config.tiny()` is a reduced version that trains
on a CPU in milliseconds. Nothing is downloaded: the data are synthetic token sequences that follow a fixed
rule, so a model has something to learn.

    config = GPT2Config.tiny()
    model = gpt2(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = synthetic_batch(config, batch=8, seq=32, generator=torch.Generator().manual_seed(0))
    loss = train_step(model, batch, optimizer)          # a 0-dim tensor; no host sync
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    vocab_size: int = 50257
    context: int = 1024

    @classmethod
    def tiny(cls) -> GPT2Config:
        """2 layers, 2 heads, d_model 64, vocabulary 512, context 64 (about 0.14M parameters)."""
        return cls(n_layer=2, n_head=2, d_model=64, vocab_size=512, context=64)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, c: GPT2Config):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.attn_proj = nn.Linear(c.d_model, c.d_model)
        self.ln_2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.mlp_proj = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (y.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer), zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for tokens [batch, seq] (seq <= context)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # output projection tied to the token embedding


def gpt2(config: GPT2Config | None = None, *, device=None, dtype: torch.dtype | None = None) -> GPT2:
    """A GPT-2 model (GPT-2 small by default) built directly on `device` (e.g. "meta" to count parameters)."""
    with torch.device(device or "cpu"):
        model = GPT2(config or GPT2Config())
    return model.to(dtype) if dtype is not None else model


def count_parameters(model: nn.Module) -> int:
    """Parameters counted once each (the tied embedding once)."""
    return sum(p.numel() for p in model.parameters())


def synthetic_batch(config: GPT2Config, batch: int, seq: int, generator: torch.Generator | None = None,
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [batch, seq] int64: random start tokens, then t[i+1] = (5 t[i] + 3) mod vocab.

    The rule makes the next token a function of the current one, so the loss of a training model falls.
    """
    if seq > config.context:
        raise ValueError(f"seq={seq} exceeds the model's context of {config.context}")
    tokens = torch.empty(batch, seq + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, config.vocab_size, (batch,), generator=generator)
    for i in range(seq):
        tokens[:, i + 1] = (5 * tokens[:, i] + 3) % config.vocab_size
    tokens = tokens.to(device or "cpu")
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """One step: zero the gradients (set to None), forward, cross-entropy, backward (gradient hooks fire here),
    optimizer step. Returns the loss as a 0-dim tensor (no host sync)."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    optimizer.step()
    return loss.detach()


def python_calls(fn) -> int:
    """The Python function calls made in fusedhooks' own code while `fn()` runs (counted with sys.setprofile)."""
    root = os.path.dirname(os.path.abspath(__file__))
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls
