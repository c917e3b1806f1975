#!/usr/bin/env python3
"""The peer's training step, for side-by-side benchmarks: transformers + PyTorch on one GPU.

Random-init Qwen3 of a public shape, bf16 weights, gradient checkpointing, SDPA attention (cuDNN's
fused kernel is PyTorch's default on Hopper), fused AdamW, and a chunked loss of 256 rows as TRL
computes it. Prints one JSON line per configuration: step seconds (median of the timed steps),
tokens/s and peak GPU memory.

    python3 scripts/bench/torch_step.py --model qwen3-0.6b --tokens 8192 32768 --steps 3

With --documents (a file of `doc_attention_bench --bounds` lines), each sequence packs those
documents, each closed by <|endoftext|> whose target is ignored, as lcx packs them with [data]
attend_across_documents = false: position ids restart at each document and transformers masks
them from those (its packed-sequence detection, without an attention mask), on --attn
(flex_attention unless told; SDPA then builds a dense T x T mask). Before timing, a small model
checks that the packed documents really are masked: a document's logits must equal those of the
same document run alone.

Qwen3-MoE shapes (qwen3-30b-a3b) run Qwen3MoeForCausalLM, its experts through --experts (one of
transformers' experts implementations, or several: each is timed); LoRA there adapts the linear
projections (attention), as PEFT's all-linear does where the experts are fused parameters.

With --lora R, the peer's LoRA: every linear projection of the decoder layers gets PEFT's branch
written by hand (PEFT is not installed here), y = base(x) + (alpha / r) * B(A(x)) with A and B in
the weights' dtype, the base frozen (autograd then skips the frozen weights' gradients), and fused
AdamW over the adapters alone.
"""
import argparse
import contextlib
import json
import os
import statistics
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,  # noqa: E402
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
}
# Other families' public shapes, with what differs from Qwen3's defaults below.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
FAMILIES = {
    "llama-3.1-8b": (LlamaConfig, LlamaForCausalLM,
                     dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                          tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE), 128000),
}


def chunked_loss(hidden, head, labels, rows=256):
    """Sum of token losses over row chunks, divided by the valid count (TRL's chunked NLL)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    valid = (labels != -100).sum()
    for s in range(0, hidden.shape[0], rows):
        h = hidden[s:s + rows]
        y = labels[s:s + rows]
        logits = (h @ head.t()).float()
        total = total + torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    return total / valid


class ChunkedLossCheckpoint(torch.autograd.Function):
    """Recomputes each chunk's logits in backward so that only one chunk's logits live at a time."""

    @staticmethod
    def forward(ctx, hidden, head, labels, rows):
        ctx.save_for_backward(hidden, head, labels)
        ctx.rows = rows
        with torch.no_grad():
            return chunked_loss(hidden, head, labels, rows)

    @staticmethod
    def backward(ctx, grad):
        hidden, head, labels = ctx.saved_tensors
        dh = torch.zeros_like(hidden)
        dw = torch.zeros_like(head, dtype=torch.float32)
        valid = (labels != -100).sum()
        for s in range(0, hidden.shape[0], ctx.rows):
            y = labels[s:s + ctx.rows]
            if (y != -100).sum() == 0:
                continue
            # backward() runs with grad mode off; each chunk's small graph is built here.
            train_head = ctx.needs_input_grad[1]
            with torch.enable_grad():
                h = hidden[s:s + ctx.rows].detach().requires_grad_(True)
                w = head.detach().requires_grad_(train_head)
                logits = (h @ w.t()).float()
                loss = torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum") / valid
                grads = torch.autograd.grad(loss * grad, (h, w) if train_head else (h,))
            dh[s:s + ctx.rows] = grads[0]
            if train_head:
                dw += grads[1].float()
        return dh, dw.to(head.dtype) if ctx.needs_input_grad[1] else None, None, None


EOS = 151643


def document_bounds(path, tokens):
    """The bounds {0, ..., tokens} of the first line of `path` written for this many tokens."""
    for line in open(path):
        row = json.loads(line)
        if row["tokens"] == tokens:
            return row["bounds"]
    raise SystemExit(f"{path} has no document bounds for {tokens} tokens")


def restarting_positions(bounds, device):
    pos = torch.empty(bounds[-1], dtype=torch.long, device=device)
    for a, b in zip(bounds[:-1], bounds[1:]):
        pos[a:b] = torch.arange(b - a, device=device)
    return pos[None]


def check_masks_documents(attn):
    """Raises unless transformers masks packed documents from restarting position ids on `attn`."""
    cfg = Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).float().eval()
    bounds = [0, 100, 256]
    ids = torch.randint(0, 1000, (1, 256), device="cuda")
    # No cache, as in training: transformers looks for packed documents only without one.
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=restarting_positions(bounds, "cuda"), use_cache=False).logits[0, 100:]
        alone = model(input_ids=ids[:, 100:], position_ids=restarting_positions([0, 156], "cuda"),
                      use_cache=False).logits[0]
    diff = (packed - alone).abs().max().item()
    if not diff < 1e-3 * alone.abs().max().item():
        raise RuntimeError(f"{attn} does not mask packed documents (a document's logits differ from its own by {diff})")


class LoraLinear(torch.nn.Module):
    """nn.Linear plus PEFT's LoRA branch (dropout 0): base(x) + scale * lora_B(lora_A(x))."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base
        self.scale = alpha / r
        out_f, in_f = base.weight.shape
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = torch.nn.Parameter(torch.empty(r, in_f, **kw).uniform_(-in_f ** -0.5, in_f ** -0.5))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_f, r, **kw))

    def forward(self, x):
        return self.base(x) + self.scale * torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_A),
                                                                      self.lora_B)


def add_lora(model, r, alpha):
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                if not isinstance(getattr(parent, n, None), torch.nn.Linear):
                    continue  # a sparse layer's experts: no linear modules of their own
                setattr(parent, n, LoraLinear(getattr(parent, n), r, alpha))
    model.enable_input_require_grads()  # checkpointed layers see an input that needs a gradient


def run(model_name, tokens, steps, layers=None, offload=False, bounds=None, attn="sdpa", lora=0, experts=None):
    moe = "num_experts" in SHAPES.get(model_name, {})
    top = EOS
    if model_name in FAMILIES:
        Config, Model, shape, top = FAMILIES[model_name]
        cfg = Config(max_position_embeddings=max(131072, tokens), **shape)
    else:
        Config, Model = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
        cfg = Config(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=max(40960, tokens), **SHAPES[model_name])
    if layers:
        cfg.num_hidden_layers = layers
    cfg._attn_implementation = attn
    if experts:
        cfg._experts_implementation = experts
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Model(cfg).to(torch.bfloat16)
    if lora:
        add_lora(model, lora, 2.0 * lora)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, top, (1, tokens), device="cuda")
    positions = None
    if bounds:
        ends = torch.tensor(bounds[1:], device="cuda") - 1
        ids[0, ends] = EOS
        positions = restarting_positions(bounds, "cuda")
    labels = torch.roll(ids, -1, dims=1)[0]
    labels[-1] = -100
    if bounds:
        labels[ends] = -100  # a document's EOS predicts nothing: the next one is out of its sight
    head = model.lm_head.weight
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # Offload: what autograd saves (with checkpointing, each layer's input) waits in pinned
        # host memory, as the peer's activation offload does.
        saving = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
        with saving:
            hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state[0]
            loss = ChunkedLossCheckpoint.apply(hidden, head, labels, 256)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i > 0:  # the first step warms up allocator and kernels
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    out = dict(system="pytorch", model=model_name, layers=cfg.num_hidden_layers, tokens=tokens, offload=offload, lora=lora,
               attention=attn, experts=getattr(model.config, "_experts_implementation", None) if moe else None, documents=len(bounds) - 1 if bounds else 1, step_s=step,
               tokens_per_s=tokens / step, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
               loss=float(loss))
    print(json.dumps(out), flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES) + sorted(FAMILIES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--offload", action="store_true", help="checkpointed activations in pinned host memory")
    ap.add_argument("--documents", help="doc_attention_bench --bounds lines: pack and mask these documents")
    ap.add_argument("--attn", help="transformers' attention (sdpa; with --documents flex_attention)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA of this rank (alpha 2r) on every linear projection")
    ap.add_argument("--experts", nargs="+", default=[None],
                    help="Qwen3-MoE: transformers' experts implementations to time (e.g. eager grouped_mm batched_mm)")
    a = ap.parse_args()
    attn = a.attn or ("flex_attention" if a.documents else "sdpa")
    if a.documents:
        try:
            check_masks_documents(attn)
        except Exception as e:  # the table says why the peer has no figure
            print(json.dumps(dict(system="pytorch", model=a.model, error=f"{attn}: {e}"[:200])), flush=True)
            return
    for t in a.tokens:
        for experts in a.experts:
            try:
                run(a.model, t, a.steps, a.layers, a.offload, document_bounds(a.documents, t) if a.documents else None,
                    attn, a.lora, experts)
            except torch.OutOfMemoryError:
                print(json.dumps(dict(system="pytorch", model=a.model, tokens=t, experts=experts, error="out of memory")),
                      flush=True)
                torch.cuda.empty_cache()
            except Exception as e:  # an implementation this transformers lacks: say so, time the others
                print(json.dumps(dict(system="pytorch", model=a.model, tokens=t, experts=experts, error=str(e)[:300])),
                      flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
