"""Drive a captured target like the step graph will, and the HF oracles."""
from __future__ import annotations

import random

import torch

from specgraph.capture import Capture
from specgraph.kernels.bitmask import ancestor_masks
from specgraph.kernels.compact_kv import compact_kv_reference
from specgraph.kernels.verify import verify_greedy
from specgraph.trees import random_parents

PREFILL_CHUNK = 16


def tiny_target_for(tokenizer, seed: int = 0):
    """A two-layer random Llama over ``tokenizer``'s vocabulary: for tests of plumbing around a real
    tokenizer (chat templates, reports, caches), where exporting the real 30-layer model (~17 s a bucket
    on a 2-core CI machine) buys nothing. Claims about the real model use the real model."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is too flat to make argmax ties unlikely: sharpen the head
        model.lm_head.weight.mul_(8.0)
    return model


def root_path(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class Driver:
    """Holds per-row committed tokens; the cache holds all but each row's last (the root)."""

    def __init__(self, model, batch: int, max_length: int, seed: int = 0):
        self.model, self.batch = model, batch
        self.capture = Capture(model, max_length)
        self.rng = random.Random(seed)
        self.vocab = model.config.get_text_config().vocab_size
        self.device = next(model.parameters()).device

    def _t(self, data) -> torch.Tensor:
        return torch.as_tensor(data, device=self.device)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]):
        """Write every prompt but its last token, in chain chunks of the (B, 16) bucket."""
        b = self.batch
        self.tokens = [list(p) for p in prompts]
        lengths = [len(p) - 1 for p in prompts]
        step = self.capture.step(b, PREFILL_CHUNK)
        chain = self._t([(1 << (i + 1)) - 1 for i in range(PREFILL_CHUNK)]).expand(b, -1)
        for start in range(0, max(lengths), PREFILL_CHUNK):
            ids = self._t([(p[:-1] + [0] * PREFILL_CHUNK * 8)[start:start + PREFILL_CHUNK] for p in prompts])
            cache_len = torch.full((b,), start, device=self.device)
            step(ids, start + torch.arange(PREFILL_CHUNK, device=self.device).expand(b, -1), cache_len, chain)
        self.cache_len = self._t(lengths)

    @torch.no_grad()
    def greedy_continuation(self, row: int, steps: int) -> list[int]:
        ids = self._t([self.tokens[row]])
        out = self.model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    def random_tree(self, nodes: int, good_path: bool = True):
        """Per row: a random depth-first tree, random tokens, and (optionally) the
        target's greedy continuation drafted along one random root-to-leaf path."""
        parents, tokens = [], []
        for row in range(self.batch):
            p = random_parents(self.rng, nodes)
            t = [self.tokens[row][-1]] + [self.rng.randrange(self.vocab) for _ in range(nodes - 1)]
            if good_path and nodes > 1:  # a lone root has no path to draft
                leaf = self.rng.choice([i for i in range(nodes) if i not in p])
                path = root_path(p, leaf)
                for node, token in zip(path[1:], self.greedy_continuation(row, len(path) - 1)):
                    t[node] = token
            parents.append(p)
            tokens.append(t)
        parents = self._t(parents)
        mask, depth = ancestor_masks(parents)
        return self._t(tokens), parents, mask, depth

    @torch.no_grad()
    def tree_logits(self, tokens, mask, depth):
        step = self.capture.step(self.batch, tokens.shape[1])
        return step(tokens, self.cache_len.unsqueeze(1) + depth, self.cache_len, mask)

    @torch.no_grad()
    def oracle_logits(self, row: int, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """HF eager on each root-to-node path alone: [N, V]."""
        out = []
        for i in range(len(tokens)):
            ids = self.tokens[row] + [tokens[j] for j in root_path(parents, i)[1:]]
            out.append(self.model(self._t([ids])).logits[0, -1])
        return torch.stack(out)

    @torch.no_grad()
    def verify_and_commit(self, tokens, parents, mask, logits):
        """Greedy verify, compact the cache with the reference op, advance."""
        n = tokens.shape[1]
        acc = verify_greedy(tokens, parents, mask, logits.argmax(-1), n - 1)
        kv = self.capture.kv(self.batch)
        compact_kv_reference(kv, self.cache_len, acc.path, acc.accept_len)
        for row in range(self.batch):
            self.tokens[row] += acc.emitted[row, : acc.accept_len[row]].tolist()
        self.cache_len = self.cache_len + acc.accept_len
        return acc

    @torch.no_grad()
    def hf_cache(self, row: int):
        """HF's own K/V for the row's cached tokens (all but the root): per layer (k, v) [H_kv, T, D]."""
        ids = self._t([self.tokens[row][:-1]])
        out = self.model(ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def check_tree_against_hf(driver: Driver, nodes: int, tol: dict, same_argmax: bool = False) -> None:
    """A random tree through the captured step: every node's logits == HF eager on its root path alone."""
    tokens, parents, mask, depth = driver.random_tree(nodes=nodes)
    logits = driver.tree_logits(tokens, mask, depth)
    for row in range(driver.batch):
        want = driver.oracle_logits(row, tokens[row].tolist(), parents[row].tolist())
        torch.testing.assert_close(logits[row], want, **tol)
        if same_argmax:
            assert torch.equal(logits[row].argmax(-1), want.argmax(-1))


def check_cache_against_hf(driver: Driver, tol: dict) -> None:
    """The capture's KV cache == HF's own K/V for every row's cached tokens (sliding layers: what HF keeps)."""
    kv = driver.capture.kv(driver.batch)
    for row in range(driver.batch):
        length = int(driver.cache_len[row])
        assert length == len(driver.tokens[row]) - 1
        for layer, (k, v) in enumerate(driver.hf_cache(row)):
            kept = k.shape[1]
            torch.testing.assert_close(kv[2 * layer, row, :, length - kept:length], k, **tol)
            torch.testing.assert_close(kv[2 * layer + 1, row, :, length - kept:length], v, **tol)
