"""Activation memory of one decoder layer, replayed op by op (no torch).

``block_cost`` needs three byte figures per layer and micro-batch: what autograd saves for the
backward (``internal_bytes``, with the block input), the transient peak of a forward without grad
(``fwd_work_bytes``, beyond input and output) and the transient peak of a re-run with grad plus
its backward (``bwd_work_bytes``, beyond the saved tensors; the incoming gradient, the output and
the input gradient included). Counting tensors by hand missed what real layers do (fp32 copies in
the norms, the norm's pre-scale product, the softmax in fp32, both halves of a gated MLP,
PyTorch's order of frees), so the layer is written down here as the sequence of ops PyTorch runs
(``Tape``), with every op's new storages, the tensors autograd saves, the gradients its backward
allocates and any workspace, and ``Tape.run`` replays it the way PyTorch allocates and frees:

- forward without grad: an op's outputs are allocated, then inputs whose last use it was are freed;
- forward with grad: the same, but saved tensors stay until the backward of the last op saving them;
- backward (ops in reverse): an op allocates its input gradients (plus ``bwd_ws``, e.g. the weight
  gradient before it is added into the existing ``.grad``), then releases its output's gradient
  and its saved tensors; a second gradient for the same tensor is added in place (out of place
  into a new buffer when the existing one is the caller's incoming gradient);
- the block input is never counted (it is the plan's boundary); the incoming gradient and the
  output are held by the caller the whole time.

``tests/test_memory_model_hf.py`` measures real Hugging Face layers (Llama, Qwen2, Qwen3,
Mistral, Gemma2, GPT-2, Qwen2-MoE, Mixtral, fp32/bf16, sdpa/eager) with
``saved_tensors_hooks`` and a storage tracker and holds this model to 5% (saved) and 10% (peaks).

What the CPU measurement cannot see and the model adds for CUDA: the flash-attention backward's
workspace (an fp32 dQ accumulator and softmax row sums; dK/dV at full head count under GQA; see
``attention`` in ``layer_tape``). Kernel workspaces of matmuls (cuBLAS) are static and not modelled.
The loss head (``head_tape``: the final norm and ``models/loss.py``'s chunked cross-entropy) and
the embedding's backward (``embedding_backward_bytes``) are counted the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .units import DTYPE_BYTES

FP32 = 4
INT64 = 8


@dataclass
class _Tensor:
    nbytes: float  # new storage bytes (0 for a view)
    base: int  # the tensor owning the storage (itself unless a view)
    gbytes: float  # bytes of its gradient (0: none flows)


@dataclass
class _Op:
    name: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    saves: tuple[int, ...]
    grads: tuple[int, ...]  # inputs its backward allocates a gradient for (gbytes each)
    passes: tuple[int, ...] = ()  # inputs that receive the output's gradient itself (adds, views)
    fwd_ws: float = 0.0
    bwd_ws: float = 0.0
    matmul: bool = False  # a matmul-class op (projection, attention kernel): its outputs a partial keep stores


@dataclass
class _Buf:
    nbytes: float
    refs: int = 1
    external: bool = False


@dataclass(frozen=True)
class LayerMemory:
    saved_bytes: float  # everything saved for backward except the block input's storage
    fwd_work_bytes: float
    bwd_work_bytes: float
    breakdown: dict = field(default_factory=dict)  # op name -> saved bytes it holds first
    # A partial keep (``Schedule.partial_keep``): the new storages of the matmul-class ops, kept from the
    # forward to the backward (selective activation checkpointing's MUST_SAVE outputs), and the bytes the
    # other (elementwise) ops read and write when the backward re-runs them (``Tape.partial``).
    partial_bytes: float = 0.0
    elementwise_bytes: float = 0.0
    partial_recompute_bytes: float = 0.0  # saved tensors the elementwise recompute re-materialises (not kept ones)


class Tape:
    """A layer as ops on tensors (bytes only). ``x`` is the block input."""

    def __init__(self, input_bytes: float) -> None:
        self.t: list[_Tensor] = []
        self.ops: list[_Op] = []
        self.x = self._new(input_bytes, grad=input_bytes)
        self.out: int | None = None
        self.holds: list[tuple[int, int]] = []  # (tensor, op index): Python keeps it alive until then
        self.peak_at: tuple | None = None  # (op, alive storages) at the no-grad forward's peak, for debugging

    def hold(self, *tensors: int) -> None:
        """Python still references ``tensors`` when the last recorded op runs (a module's input until
        it returns, a function's locals until it returns): they are freed no earlier than that."""
        for t in tensors:
            self.holds.append((t, len(self.ops) - 1))

    def _new(self, nbytes: float, *, grad: float | None = None, base: int | None = None) -> int:
        i = len(self.t)
        self.t.append(_Tensor(nbytes=float(nbytes), base=i if base is None else base,
                              gbytes=float(nbytes if grad is None else grad)))
        return i

    def op(self, name: str, ins: tuple[int, ...] | list[int], out_bytes: list[float], *, saves=(), grads=(),
           passes=(), fwd_ws: float = 0.0, bwd_ws: float = 0.0, save_outs: tuple[int, ...] = (),
           out_grads: list[float] | None = None, view_of: int | None = None, matmul: bool = False) -> list[int]:
        """Record an op; returns its outputs. ``out_bytes``: new storage per output (with ``view_of``:
        the outputs are views of that tensor's storage and ``out_bytes`` are their gradients' bytes).
        ``saves``/``save_outs``: inputs / output indices autograd keeps; ``grads``: inputs its backward
        allocates a gradient for; ``passes``: inputs that get the output's gradient itself."""
        if view_of is not None:
            base = self.t[view_of].base
            outs = [self._new(0.0, grad=b, base=base) for b in out_bytes]
        else:
            outs = [self._new(b, grad=None if out_grads is None else out_grads[k]) for k, b in enumerate(out_bytes)]
        saved = tuple(dict.fromkeys(tuple(self.t[s].base for s in saves)
                                    + tuple(self.t[outs[k]].base for k in save_outs)))  # storages, once each
        self.ops.append(_Op(name, tuple(ins), tuple(outs), saved, tuple(grads), tuple(passes), fwd_ws, bwd_ws, matmul))
        return outs

    def partial(self) -> tuple[float, float, float]:
        """(partial bytes, elementwise bytes, recompute bytes) of a partial keep: the new storages of every
        matmul-class op (kept from the forward to the backward, whether the backward needs them or not:
        selective checkpointing stores every MUST_SAVE output); the bytes the remaining ops read (each
        distinct input storage once per op) and write (their new storages) when the backward re-runs them
        (views move nothing); and the saved tensors (without the input) that are not kept outputs, which
        that recompute re-materialises."""
        base = [t.base for t in self.t]
        outs = {o for op in self.ops if op.matmul for o in op.outs if base[o] == o}
        kept = sum(self.t[o].nbytes for o in outs)
        saved = {s for op in self.ops for s in op.saves if s != base[self.x]}
        rest = sum(self.t[s].nbytes for s in saved - outs)
        moved = 0.0
        for op in self.ops:
            if op.matmul:
                continue
            new = sum(self.t[o].nbytes for o in op.outs if base[o] == o)
            if new == 0:
                continue  # a view
            moved += new + sum(self.t[b].nbytes for b in dict.fromkeys(base[i] for i in op.ins))
        return kept, moved, rest

    # ---- the replay ---------------------------------------------------------------------------
    def run(self) -> LayerMemory:
        """Replay the ops: saved bytes, forward work and backward work (see the module doc)."""
        assert self.out is not None
        n = len(self.t)
        base = [t.base for t in self.t]
        last_use = [-1] * n
        for k, op in enumerate(self.ops):
            for i in op.ins:
                last_use[base[i]] = max(last_use[base[i]], k)
        for i, k in self.holds:
            last_use[base[i]] = max(last_use[base[i]], k)
        keep = {base[self.x], base[self.out]}
        holders = [0] * n
        first_saver: dict[int, str] = {}
        for op in self.ops:
            for s in op.saves:
                holders[s] += 1
                first_saver.setdefault(s, op.name)
        saved = {s for s in range(n) if holders[s] and s != base[self.x]}
        saved_bytes = sum(self.t[s].nbytes for s in saved)
        breakdown: dict[str, float] = {}
        for s in saved:
            breakdown[first_saver[s]] = breakdown.get(first_saver[s], 0.0) + self.t[s].nbytes

        def forward(grad_mode: bool, live: float, peak: float) -> tuple[float, float]:
            alive: set[int] = set()
            for k, op in enumerate(self.ops):
                for o in op.outs:
                    if base[o] == o:
                        alive.add(o)
                        live += self.t[o].nbytes
                if live + op.fwd_ws > peak:
                    peak = live + op.fwd_ws
                    if not grad_mode:
                        self.peak_at = (op.name, [(self.t[b].nbytes, b) for b in sorted(alive)])
                for b in sorted(alive):
                    if last_use[b] <= k and b not in keep and not (grad_mode and holders[b]):
                        alive.discard(b)
                        live -= self.t[b].nbytes
            return live, peak

        # forward without grad: peak beyond the input, minus the output the plan counts as a boundary
        _, peak = forward(False, 0.0, 0.0)
        fwd_work = max(0.0, peak - self.t[self.out].nbytes)

        # re-run with grad and backward, the incoming gradient held by the caller from the start
        g = self.t[self.out].gbytes
        live, peak = forward(True, g, g)
        left = list(holders)
        grad: dict[int, _Buf] = {self.out: _Buf(g, external=True)}

        def release(buf: _Buf) -> None:
            nonlocal live
            buf.refs -= 1
            if buf.refs == 0 and not buf.external:
                live -= buf.nbytes

        for op in reversed(self.ops):
            incoming = [grad.pop(o) for o in op.outs if o in grad]
            if incoming:
                new: list[tuple[int, _Buf]] = []
                for i in op.grads:
                    if self.t[i].gbytes <= 0:
                        continue
                    live += self.t[i].gbytes
                    new.append((i, _Buf(self.t[i].gbytes)))
                peak = max(peak, live + op.bwd_ws)
                for i in op.passes:
                    incoming[0].refs += 1
                    new.append((i, incoming[0]))
                for buf in incoming:
                    release(buf)
            else:
                new = []
            for s in op.saves:
                left[s] -= 1
                if left[s] == 0 and s not in keep:
                    live -= self.t[s].nbytes
            for i, buf in new:
                old = grad.get(i)
                if old is None:
                    grad[i] = buf
                elif old.external or old.refs > 1 or buf is old:
                    # out of place: a new sum, then both addends go
                    total = _Buf(max(old.nbytes, buf.nbytes))
                    live += total.nbytes
                    peak = max(peak, live)
                    release(old)
                    if buf is not old:
                        release(buf)
                    grad[i] = total
                else:
                    release(buf)  # added in place into the existing gradient
        bwd_work = max(0.0, peak - saved_bytes)
        partial_bytes, elementwise_bytes, rest = self.partial()
        return LayerMemory(saved_bytes=saved_bytes, fwd_work_bytes=fwd_work, bwd_work_bytes=bwd_work,
                           breakdown=breakdown, partial_bytes=partial_bytes, elementwise_bytes=elementwise_bytes,
                           partial_recompute_bytes=rest)


# ---- the decoder layers ----------------------------------------------------------------------------
def _cast(T: Tape, name: str, x: int, elems: float, to_bytes: int, from_bytes: int) -> int:
    """``x.to(dtype)``: a new tensor unless the dtype is already right."""
    if to_bytes == from_bytes:
        return x
    return T.op(name, [x], [elems * to_bytes], grads=[x])[0]


def _norm(T: Tape, kind: str, e: int, name: str, x: int, elems: float, rows: float) -> int:
    """One norm over ``elems`` elements in ``rows`` rows (``ModelSpec.norm``)."""
    if kind == "layer":  # native kernel: saves its input and fp32 mean/rstd; no fp32 copies
        return T.op(name, [x], [elems * e, rows * FP32, rows * FP32], saves=[x], save_outs=(1, 2), grads=[x],
                    out_grads=[elems * e, 0, 0])[0]
    xf = _cast(T, name + ".to_fp32", x, elems, FP32, e)
    sq = T.op(name + ".pow", [xf], [elems * FP32], saves=[xf], grads=[xf], bwd_ws=2 * elems * FP32)[0]
    var = T.op(name + ".mean", [sq], [rows * FP32], grads=[sq])[0]
    var = T.op(name + ".eps", [var], [rows * FP32], passes=[var])[0]
    r = T.op(name + ".rsqrt", [var], [rows * FP32], save_outs=(0,), grads=[var])[0]
    y = T.op(name + ".normed", [xf, r], [elems * FP32], saves=[xf, r], grads=[xf, r], bwd_ws=elems * FP32)[0]
    if kind == "rms_fp32":  # Gemma: (y * (1 + w)) in fp32, then to the compute dtype
        o = T.op(name + ".scale", [y], [elems * FP32], saves=[y], grads=[y], bwd_ws=elems * FP32)[0]
        return _cast(T, name + ".to_dtype", o, elems, e, FP32)
    yc = _cast(T, name + ".to_dtype", y, elems, e, FP32)  # Llama: w * y.to(dtype)
    out = T.op(name + ".scale", [yc], [elems * e], saves=[yc], grads=[yc], bwd_ws=elems * e)[0]
    T.hold(y)  # the fp32 y is a local until the norm returns
    return out


def layer_tape(model, train) -> Tape:
    """The ops of one decoder layer of ``model`` (a ``ModelSpec``) for one micro-batch of ``train``.

    Layouts (``ModelSpec`` fields): pre-norm ``norm`` -> attention (``attn_implementation``; GQA;
    RoPE unless ``norm == "layer"``, GPT-2's learned positions live outside the block; GPT-2's fused
    q/k/v projection when ``bias``) -> [``post_norms``] -> residual -> pre-norm -> MLP (``mlp``,
    ``activation``; or routed experts) -> [``post_norms``] -> residual. Dropout is taken as off."""
    e = DTYPE_BYTES[train.dtype]
    n, s = train.tokens, train.seq_len
    h, f, d = model.hidden, model.intermediate, model.head_dim
    heads, kvh = model.heads, model.kv_heads
    q, kv = heads * d, kvh * d
    T = Tape(n * h * e)
    gpt2 = model.norm == "layer"

    def linear(name, x, n_in, n_out, bias=False):
        w = (n_in * n_out + (n_out if bias else 0)) * e  # the weight (and bias) gradient before it joins .grad
        return T.op(name, [x], [n * n_out * e], saves=[x], grads=[x], bwd_ws=w, matmul=True)[0]

    def cast(name, x, elems, to_bytes, from_bytes):
        return _cast(T, name, x, elems, to_bytes, from_bytes)

    def norm(name, x, elems, rows):
        return _norm(T, model.norm, e, name, x, elems, rows)

    def rope(name, t, elems):
        """t * cos + rotate_half(t) * sin; rotate_half = cat(-t[..., d/2:], t[..., :d/2])."""
        b = elems * e
        c = T.op(name + ".cos", [t], [b], grads=[t])[0]
        lo = T.op(name + ".lo", [t], [b / 2], grads=[t], view_of=t)[0]  # slices: backward allocates a full zero tensor
        hi = T.op(name + ".hi", [t], [b / 2], grads=[t], view_of=t)[0]
        neg = T.op(name + ".neg", [hi], [b / 2], grads=[hi])[0]
        rot = T.op(name + ".cat", [neg, lo], [b], passes=[neg, lo])[0]
        sn = T.op(name + ".sin", [rot], [b], grads=[rot])[0]
        return T.op(name + ".add", [c, sn], [b], passes=[c, sn])[0]

    def activation(name, x, elems):
        b = elems * e
        if model.activation == "relu":
            return T.op(name, [x], [b], save_outs=(0,), grads=[x])[0]
        if model.activation != "gelu_new":  # one kernel, saves its input
            return T.op(name, [x], [b], saves=[x], grads=[x])[0]
        # HF NewGELU in Python: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))
        half = T.op(name + ".half", [x], [b], grads=[x])[0]
        cube = T.op(name + ".pow", [x], [b], saves=[x], grads=[x], bwd_ws=2 * b)[0]
        cube = T.op(name + ".mul", [cube], [b], grads=[cube])[0]
        inner = T.op(name + ".add", [x, cube], [b], passes=[x, cube])[0]
        inner = T.op(name + ".scale", [inner], [b], grads=[inner])[0]
        th = T.op(name + ".tanh", [inner], [b], save_outs=(0,), grads=[inner])[0]
        one = T.op(name + ".one", [th], [b], passes=[th])[0]
        return T.op(name + ".mul2", [half, one], [b], saves=[half, one], grads=[half, one])[0]

    def attention(x):
        if gpt2:  # fused c_attn, split into q, k, v views of one storage
            qkv = linear("attn.qkv", x, h, q + 2 * kv, bias=True)
            qt, kt, vt = T.op("attn.split", [qkv], [n * q * e, n * kv * e, n * kv * e], grads=[qkv], view_of=qkv)
        else:
            bias = model.qkv_bias or model.bias
            qt = linear("attn.q", x, h, q, bias)
            kt = linear("attn.k", x, h, kv, bias)
            vt = linear("attn.v", x, h, kv, bias)
            if model.qk_norm:
                qt = norm("attn.q_norm", qt, n * q, n * heads)
                kt = norm("attn.k_norm", kt, n * kv, n * kvh)
            q0, k0 = qt, kt
            qt = rope("attn.rope_q", qt, n * q)
            kt = rope("attn.rope_k", kt, n * kv)
            T.hold(q0, k0)  # apply_rotary_pos_emb's arguments until it returns both
        attn_locals = [x, qkv] if gpt2 else [x, qt, kt, vt]  # the module's locals until it returns
        if model.attn_implementation == "sdpa":
            # flash kernels (CPU and CUDA): save q, k, v, out and fp32 log-sum-exp rows; GQA without copies.
            # CUDA's backward adds an fp32 dQ accumulator and fp32 row sums, and dK/dV at full head count
            # under GQA (FlashAttention-2's mha_bwd); the CPU kernel's workspace is not visible.
            ws = n * q * FP32 + n * heads * FP32 + (2 * n * q * e if kvh < heads else 0)
            o = T.op("attn.sdpa", [qt, kt, vt], [n * q * e, n * heads * FP32], saves=[qt, kt, vt], save_outs=(0, 1),
                     grads=[qt, kt, vt], bwd_ws=ws, out_grads=[n * q * e, 0], matmul=True)[0]
            out = linear("attn.o", o, q, h, model.bias)
            T.hold(*attn_locals)
            return out, None
        # eager: scores [B, heads, S, S] per token heads * S
        sc = n * heads * s
        if gpt2:  # q, k^T, v are strided views of c_attn's output: matmul copies them
            qt = T.op("attn.q_copy", [qt], [n * q * e], passes=[qt])[0]
            kt = T.op("attn.k_copy", [kt], [n * kv * e], passes=[kt])[0]
            vt = T.op("attn.v_copy", [vt], [n * kv * e], passes=[vt])[0]
        elif kvh < heads:  # repeat_kv: expand + reshape copies to the full head count
            kt = T.op("attn.repeat_k", [kt], [n * q * e], grads=[kt])[0]
            vt = T.op("attn.repeat_v", [vt], [n * q * e], grads=[vt])[0]
        a = T.op("attn.qk", [qt, kt], [sc * e], saves=[qt, kt], grads=[qt, kt], matmul=True)[0]
        a = T.op("attn.scaling", [a], [sc * e], grads=[a])[0]
        if model.attn_softcap:
            a = T.op("attn.softcap_div", [a], [sc * e], grads=[a])[0]
            a = T.op("attn.softcap_tanh", [a], [sc * e], save_outs=(0,), grads=[a])[0]
            a = T.op("attn.softcap_mul", [a], [sc * e], grads=[a])[0]
        masked = T.op("attn.mask", [a], [sc * e], passes=[a])[0]
        pb = FP32 if model.softmax_fp32 else e
        a = cast("attn.to_fp32", masked, sc, pb, e)
        p = T.op("attn.softmax", [a], [sc * pb], save_outs=(0,), grads=[a])[0]
        p = cast("attn.probs_to_dtype", p, sc, e, pb)
        T.hold(masked)  # softmax(masked, dtype=fp32).to(dtype): the argument lives through the whole line
        o = T.op("attn.pv", [p, vt], [n * q * e], saves=[p, vt], grads=[p, vt], matmul=True)[0]
        T.hold(kt, vt)  # eager_attention_forward's locals (repeated k, v) until it returns
        o = T.op("attn.transpose", [o], [n * q * e], passes=[o])[0]  # transpose(1, 2).contiguous()
        out = linear("attn.o", o, q, h, model.bias)
        T.hold(*attn_locals)
        return out, p  # eager returns its probabilities: the layer's local until it returns

    def gated(name, x, width):
        g = linear(name + ".gate", x, h, width)
        a = activation(name + ".act", g, n * width)
        u = linear(name + ".up", x, h, width)
        p = T.op(name + ".mul", [a, u], [n * width * e], saves=[a, u], grads=[a, u])[0]
        out = linear(name + ".down", p, width, h)
        T.hold(x)  # the MLP's input until it returns
        return out

    def experts(x):
        """Routed experts as transformers' grouped_mm path runs them (Qwen2-MoE, Mixtral, ...)."""
        k, ne, fe = model.experts_per_token, model.num_experts, model.expert_intermediate
        shared = gated("mlp.shared", x, model.shared_expert_intermediate) if model.shared_expert_intermediate else None
        logits = linear("router", x, h, ne)
        lf = cast("router.to_fp32", logits, n * ne, FP32, e)
        probs = T.op("router.softmax", [lf], [n * ne * FP32], save_outs=(0,), grads=[lf])[0]
        top, idx = T.op("router.topk", [probs], [n * k * FP32, n * k * INT64], save_outs=(1,), grads=[probs],
                        out_grads=[n * k * FP32, 0])
        # renormalised top-k weights (Mixtral; Qwen3-MoE; counted for every router: a few bytes per token)
        tot = T.op("router.sum", [top], [n * FP32], grads=[top])[0]
        keep = T.op("router.clone", [top], [n * k * FP32], passes=[top])[0]
        w = T.op("router.div", [keep, tot], [n * k * FP32], saves=[keep, tot], grads=[keep, tot])[0]
        rw = FP32 if model.router_weights_fp32 else e  # Qwen-MoE casts the weights to the compute dtype
        w = cast("router.to_dtype", w, n * k, rw, FP32)
        ob = max(e, rw)  # the weighted expert outputs: fp32 when the weights are (type promotion)
        nk = n * k
        perm, ids = T.op("experts.sort", [idx], [nk * INT64, nk * INT64], out_grads=[0, 0])
        rows = T.op("experts.rows", [perm], [nk * INT64], out_grads=[0])[0]
        xs = T.op("experts.gather", [x, rows], [nk * h * e], saves=[rows], grads=[x], bwd_ws=n * h * e)[0]
        ws = T.op("experts.weights", [w, perm], [nk * rw], saves=[perm], grads=[w])[0]
        offs = T.op("experts.offsets", [ids], [ne * 4], out_grads=[0])[0]
        gu = T.op("experts.gate_up", [xs, offs], [nk * 2 * fe * e], saves=[xs, offs], grads=[xs],
                  bwd_ws=ne * 2 * fe * h * e, matmul=True)[0]
        g, u = T.op("experts.chunk", [gu], [nk * fe * e, nk * fe * e], grads=[gu], view_of=gu)
        a = activation("experts.act", g, nk * fe)
        p = T.op("experts.mul", [a, u], [nk * fe * e], saves=[a, u], grads=[a, u])[0]
        dn = T.op("experts.down", [p, offs], [nk * h * e], saves=[p, offs], grads=[p], bwd_ws=ne * fe * h * e,
                  matmul=True)[0]
        # backward: dL/d(dn) in the output dtype, then cast to dn's; the weights' gradient unreduced first
        wo = T.op("experts.weigh", [dn, ws], [nk * h * ob], saves=[dn, ws], grads=[dn, ws],
                  bwd_ws=nk * h * ob + (nk * h * ob if ob != e else 0))[0]
        inv = T.op("experts.inv_perm", [perm], [nk * INT64], out_grads=[0])[0]
        # an index's backward: zeros, then an out-of-place index_put
        wo = T.op("experts.unsort", [wo, inv], [nk * h * ob], saves=[inv], grads=[wo], bwd_ws=nk * h * ob)[0]
        out = T.op("experts.sum", [wo], [n * h * ob], passes=[wo])[0]
        out = cast("experts.to_dtype", out, n * h, e, ob)
        T.hold(xs, ws, perm, ids, rows, idx, w, dn)  # the experts function's locals until it returns
        if shared is None:
            T.hold(x, logits)  # the block's input and its router logits (a local) until it returns
            return out
        sg = linear("mlp.shared_gate", x, h, 1)
        sg = T.op("mlp.shared_sigmoid", [sg], [n * e], save_outs=(0,), grads=[sg])[0]
        shared = T.op("mlp.shared_weigh", [sg, shared], [n * h * e], saves=[sg, shared], grads=[sg, shared],
                      bwd_ws=n * h * e)[0]
        out = T.op("mlp.add_shared", [out, shared], [n * h * e], passes=[out, shared])[0]
        T.hold(x, logits)
        return out

    def mlp(x):
        if model.num_experts:
            return experts(x)
        if model.mlp == "gated":
            return gated("mlp", x, f)
        a = linear("mlp.fc", x, h, f, model.bias)
        a = activation("mlp.act", a, n * f)
        return linear("mlp.proj", a, f, h, model.bias)

    x = T.x
    a, probs = attention(norm("norm1", x, n * h, n))
    y = norm("post_attn_norm", a, n * h, n) if model.post_norms else a
    x2 = T.op("residual1", [x, y], [n * h * e], passes=[x, y])[0]
    n2 = norm("norm2", x2, n * h, n)
    y = mlp(n2)
    if model.post_norms:
        y = norm("post_mlp_norm", y, n * h, n)
    T.out = T.op("residual2", [x2, y], [n * h * e], passes=[x2, y])[0]
    T.hold(*[t for t in (probs,) if t is not None])  # eager's probabilities: a local of the layer
    if gpt2:
        T.hold(a, n2)  # GPT-2's block keeps attn_output and ln_2's output in locals until it returns
    return T


def layer_memory(model, train) -> LayerMemory:
    """Saved bytes (without the input's storage) and the forward / backward working sets of one layer."""
    return layer_tape(model, train).run()


# ---- the loss head ----------------------------------------------------------------------------------
def head_tape(model, train) -> Tape:
    """Final norm and the chunked cross-entropy of ``models/loss.py`` (``train.loss_chunk_tokens`` rows of
    logits at a time, gradients computed in the forward); the input is the last boundary."""
    e = DTYPE_BYTES[train.dtype]
    n, h, v = train.tokens, model.hidden, model.vocab
    chunk = min(train.loss_chunk_tokens, n)
    T = Tape(n * h * e)
    normed = _norm(T, model.norm, e, "final_norm", T.x, n * h, n)
    # per chunk: the logits in the compute dtype and their fp32 copy (made probabilities in place), then the
    # gradient in the compute dtype; until the backward: d(hidden) [n, h] and d(weight) [V, h] (compute dtype)
    ws = chunk * v * (FP32 + (e if e != FP32 else 0)) + chunk * 4 * FP32  # + row max, sum, target logit, loss
    loss = T.op("loss", [normed], [n * h * e, v * h * e, FP32], save_outs=(0, 1), grads=[normed], fwd_ws=ws,
                bwd_ws=-n * h * e, out_grads=[0, 0, FP32])[2]
    # (bwd_ws: the gradient it hands to the norm is d(hidden) itself, scaled in place, not a new tensor)
    T.out = loss
    return T


def head_work_bytes(model, train) -> float:
    """Peak bytes of the loss head's window beyond its input: final norm and loss forward with grad, then
    their backward (the LM head weight's gradient added into ``.grad``, the norm's backward)."""
    mem = head_tape(model, train).run()
    return mem.saved_bytes + mem.bwd_work_bytes


def embedding_backward_bytes(model, train) -> float:
    """Peak of the embedding's backward (window B0, after layer 0's): the input gradient of layer 0 and the
    dense [V, h] weight gradient ``nn.Embedding`` builds before it is added into ``.grad``."""
    e = DTYPE_BYTES[train.dtype]
    return train.tokens * model.hidden * e + model.vocab * model.hidden * e
