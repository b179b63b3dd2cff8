"""Code generation for replay: the recording turned into straight-line Python.

Owns what happens to the recorded ops at capture end, apart from deciding
the survivors (:mod:`graphrunner.tape.survivors`): hoisting views of
externals and constant factories (:func:`hoist`, computed once), merging
aliases and common subexpressions, rewriting views of internal storages as
one ``as_strided``, dead-code elimination, and the generated ``_replay``
function with its bound values as closure cells (:func:`generate`,
:class:`_Program`).  The generated code never runs under a dispatch mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .bindings import VF
from .collapse import COLLAPSIBLE, COLLAPSIBLE_FUNCTIONAL, collapse, collapse_functional, view_like
from .recording import FUNCTIONAL_COLLECTIVES, RecordedOp, Ref, extent
from .state import in_session, on_session_end

# Code objects of generated sources within a capture session (compiled_source): source text -> code.
# Keys whose shapes differ only where the text does not show them (a KV-length dim, which only the
# externals' shapes carry) generate the same text.  Emptied when the outermost session exits.
_CODE: dict[tuple[str, str], Any] = {}
_CODE_MAX = 256
on_session_end(_CODE.clear)
#: ``[compiled, reused]``: generated sources compiled, and those answered by the session's cache.
CODE_STATS = [0, 0]


def compiled_source(src: str, filename: str) -> Any:
    """``compile(src, filename, "exec")``, reused within a capture session for a source text compiled
    before (a code object is immutable: each ``exec`` of it makes fresh functions, with their own
    bindings)."""
    key = (src, filename)
    code = _CODE.get(key)
    if code is not None:
        CODE_STATS[1] += 1
        return code
    code = compile(src, filename, "exec")
    CODE_STATS[0] += 1
    if in_session() and len(_CODE) < _CODE_MAX:
        _CODE[key] = code
    return code


def _literal(v) -> str | None:
    """Source text for a constant that round-trips exactly, else None."""
    if v is None or isinstance(v, (bool, str)):
        return repr(v)
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return None
        return repr(v)
    if isinstance(v, (tuple, list)):
        maybe = [_literal(x) for x in v]
        parts = [p for p in maybe if p is not None]
        if len(parts) != len(maybe):
            return None
        if isinstance(v, tuple):
            return "(" + "".join(p + ", " for p in parts) + ")"
        return "[" + ", ".join(parts) + "]"
    return None


class _Program:
    """The generated replay function and what it binds."""

    fn: Callable[[], None]  # set by generate() once every line is in (build())
    source: str  # set by build()

    def __init__(self):
        self.env: dict[str, Any] = {}
        self.lines: list[str] = []
        self.labels: dict[str, str] = {}  # env name -> aten op name, for callees without a __name__
        self._consts: dict[int, str] = {}

    def const(self, v, prefix="c") -> str:
        key = id(v)
        n = self._consts.get(key)
        if n is None:
            n = f"{prefix}{len(self.env)}"
            self.env[n] = v
            self._consts[key] = n
        return n

    def build(self) -> Callable[[], None]:
        names = list(self.env)
        body = "\n".join("        " + ln for ln in self.lines) or "        pass"
        # Bound values become closure cells of _replay (LOAD_DEREF: no per-call setup).
        src = f"def _make({', '.join(names)}):\n    def _replay():\n{body}\n    return _replay\n"
        self.source = src
        code = compiled_source(src, "<tape replay>")
        ns: dict[str, Any] = {}
        exec(code, ns)
        return ns["_make"](**self.env)


def hoist(cap) -> tuple[set, dict]:
    """Step 1 (TAPE-NOTES item 2): a pure op whose inputs are all externals /
    constants and whose outputs really share storage with an input is a view
    of an external: keep the capture-time tensor.  A pure factory (no tensor
    input) is constant if nothing ever writes its storage.  Marks those ops
    ``fast = "hoisted"`` and their outputs ``"const"`` in ``cap.kind``.

    Returns ``(const_storages, consts)``: storage keys of the constants, and
    name -> tensor of every external and constant (taken before
    :func:`~graphrunner.tape.survivors.find_survivors` clears the capture's
    references)."""
    ops = cap.ops
    kind = cap.kind
    for op in ops:
        if not op.pure or not op.new:
            continue
        if any(kind[n] != "ext" and kind[n] != "const" for n in op.in_names):
            continue
        if op.in_names:
            ok = all(k is not None and k in op.in_skeys for k in op.out_skeys)
        else:
            ok = all(k is not None and k not in cap.written for k in op.out_skeys)
        if ok:
            op.fast = "hoisted"
            for n in op.new:
                kind[n] = "const"
    const_storages = {cap.skey[n] for n, k in kind.items() if k == "const"}
    consts = {n: cap.strong[n] for n, k in kind.items() if k in ("ext", "const")}
    return const_storages, consts


def generate(cap, consts: dict, survivors: dict, spills: dict | None = None, scratch=None) -> tuple[_Program, int]:
    """Steps 3-5: aliases and CSE, views of internal storages as
    ``as_strided``, dead-code elimination, then the straight-line replay
    code (each survivor refreshed in place by ``copy_``; each temporary in
    ``spills`` also written into its tensor there, the pool memory a CUDA
    capture would have given it).  Returns the built
    program (``prog.fn``, ``prog.source``, ``prog.env``) and the number of
    ops it replays. ``scratch``: where planned temporaries live (see
    :func:`plan_buffers`)."""
    ops = cap.ops
    # 3. Aliases and common subexpressions.  canon maps a value's name to
    #    the name of an equal value computed earlier.
    canon: dict[str, str] = {}

    def cn(n: str) -> str:
        while n in canon:
            n = canon[n]
        return n

    def unify(later: str, earlier: str) -> None:
        a, b = cn(later), cn(earlier)
        if a != b:
            canon[a] = b

    surv_storages = {k for k, alloc in cap.internal_storages.items() if alloc in survivors}
    if not cap.meta_mutated:  # an in-place metadata change (unsqueeze_, ...) breaks "same metadata"
        # Externals / hoisted views that are the same view of the same
        # storage (e.g. `positions[:, None]` taken in every layer) are
        # interchangeable: one name, so that CSE sees equal inputs.
        by_meta: dict[tuple, str] = {}
        for n, t in consts.items():
            if type(t) is torch.Tensor and t.layout == torch.strided and cap.skey.get(n) is not None:
                mk = (cap.skey[n], t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset(), t.is_inference())
                unify(n, by_meta.setdefault(mk, n))
        # Hoisted ops repeating an earlier hoisted op (the same constant
        # factory, e.g. `torch.arange(L)` in every layer, or the same view)
        # give equal constants: never written, so one will do.
        seen_h: dict[tuple, RecordedOp] = {}
        for op in ops:
            if op.fast != "hoisted":
                continue
            try:
                first = seen_h.setdefault((op.func, _key(op.args, cn), _key(op.kwargs, cn)), op)
            except TypeError:
                continue
            if first is not op and len(first.new) == len(op.new):
                for a, b in zip(op.new, first.new):
                    unify(a, b)
        for op in ops:
            if op.fast is None and op.alias is not None:
                out_n, in_n = op.alias
                op.fast = "alias"
                unify(out_n, in_n)
    # CSE: a pure op repeating an earlier one (same op, same inputs not
    # written in between, same literal arguments) reuses its result, unless
    # a result is written later (then the two differ) or survives.
    seen: dict[tuple, RecordedOp] = {}
    for op in ops:
        if op.fast is not None or not op.pure or not op.new or torch.Tag.nondeterministic_bitwise in op.func.tags:
            continue
        refs = [r.name for _, r in _ref_paths(op.outs)]
        if refs != op.new or any(
            k is None or k in surv_storages or (k in cap.internal_storages and k in cap.written) for k in op.out_skeys
        ):
            continue
        try:
            key = (op.func, _key(op.args, cn), _key(op.kwargs, cn), op.in_vers)
            first = seen.setdefault(key, op)
        except TypeError:  # an unhashable argument
            continue
        if first is not op:
            op.fast = "cse"
            for a, b in zip(op.new, first.new):
                unify(a, b)

    # Views of internal storages -> as_strided on the allocating tensor (its
    # layout is the same at every replay, shapes being frozen).  Not after
    # set_ / resize_, which can swap a storage.
    if not cap.meta_mutated:
        for op in ops:
            if op.fast is None and op.view is not None:
                base, size, stride, offset = op.view
                op.call = VF.as_strided
                op.cargs = ((Ref(base), size, stride, offset), {})
                op.in_names = [base]

    # 4. Dead-code elimination: keep ops with effects, ops producing
    #    survivors, and ops whose outputs feed kept ops.
    keep = [False] * len(ops)
    needed: set[str] = set()
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.fast is not None:
            continue
        live = (not op.pure) or any(n in needed or n in survivors for n in op.new)
        if live and op.pure and not op.new:
            live = False  # returns its input unchanged (e.g. .to() no-op)
        if live:
            keep[i] = True
            needed.update(cn(n) for n in op.in_names)

    # 4b. Memory plan: results written into preplanned buffers (out=).
    planned = plan_buffers(cap, ops, keep, cn, survivors, surv_storages, spills or {}, consts, scratch)

    # 5. Generate straight-line code.
    prog = _Program()
    ref_expr: dict[str, str] = {}
    for n, t in consts.items():
        ref_expr[n] = prog.const(t, "k")
    static_names = {}
    for n, t in survivors.items():
        static_names[n] = prog.const(t, "s")
    last_use: dict[str, int] = {}
    for i, op in enumerate(ops):
        if keep[i]:
            for n in op.in_names:
                last_use[cn(n)] = i

    def expr(v) -> str:
        if isinstance(v, Ref):
            return ref_expr[cn(v.name)]
        lit = _literal(v)
        if lit is not None:
            return lit
        if isinstance(v, (list, tuple)):
            if v and all(isinstance(x, Ref) and cn(x.name) in consts for x in v):
                # only constants: build the list once (ops do not modify their list arguments)
                return prog.const(type(v)(consts[cn(x.name)] for x in v))
            inner = ", ".join(expr(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner},)"
        return prog.const(v)

    # A functional collective's result is written by the collective until a wait_tensor on it: its refresh
    # copies (survivor, spill) wait for that wait, and a result never waited in the recording is waited at the
    # end of the replay (a CUDA graph's stream has finished the collective by then).  {name: copy lines}
    unwaited: dict[str, list[str]] = {}

    def waited(n: str) -> None:
        """``n``'s collective was waited on: refresh its copies now, read the static tensor from here on."""
        prog.lines.extend(unwaited.pop(n))
        if n in static_names:
            ref_expr[n] = static_names[n]
            prog.lines.append(f"del {n}")

    n_ops = 0
    for i, op in enumerate(ops):
        if not keep[i]:
            continue
        n_ops += 1
        if op.view is not None and op.view[0] in planned.views:
            # a view of a preplanned buffer: the same tensor at every replay
            ref_expr[op.new[0]] = prog.const(planned.views[op.view[0]][op.new[0]], "b")
            continue
        buf = planned.out.get(i)
        if buf is not None:
            n = op.outs.name
            b = static_names[n] if n in static_names else prog.const(buf, "b")
            direct = planned.direct.get(i)
            if direct is not None:  # the one kernel the composite reaches, on its views
                kfn, kargs, kout = direct
                prog.lines.append(
                    f"{prog.const(kfn, 'f')}("
                    + ", ".join([prog.const(t, "m") for t in kargs] + [f"out={prog.const(kout, 'm')}"])
                    + ")"
                )
            else:
                assert op.out_ok, "a functional composite is planned only as its kernel"
                f = prog.const(op.call, "f")
                cargs, ckwargs = op.cargs
                prog.lines.append(
                    f"{f}("
                    + ", ".join(
                        [expr(a) for a in cargs] + [f"{k}={expr(v)}" for k, v in ckwargs.items()] + [f"out={b}"]
                    )
                    + ")"
                )
            ref_expr[n] = b
            dead = [
                cn(m)
                for m in set(op.in_names)
                if last_use.get(cn(m)) == i and ref_expr.get(cn(m)) == cn(m) and cn(m) not in unwaited
            ]
            if dead:
                prog.lines.append("del " + ", ".join(sorted(set(dead))))
            continue
        if op.call is not None:
            f = prog.const(op.call, "f")
            cargs, ckwargs = op.cargs
        else:
            f = prog.const(op.func._op, "f")
            prog.labels[f] = str(op.func)
            cargs, ckwargs = op.args, op.kwargs
        call = f"{f}(" + ", ".join([expr(a) for a in cargs] + [f"{k}={expr(v)}" for k, v in ckwargs.items()]) + ")"
        lines = prog.lines
        newset = set(op.new)
        paths = list(_ref_paths(op.outs))
        if op.collective:
            lines.append(f"_o = {call}")
            for path in _work_paths(op.outs):
                lines.append(f"_o{path}.wait()")
            bind_src = "_o"
        elif not newset:
            lines.append(call)
            bind_src = None
        elif isinstance(op.outs, Ref):
            lines.append(f"{op.outs.name} = {call}")
            bind_src = None
        elif isinstance(op.outs, (list, tuple)) and all(isinstance(x, Ref) for x in op.outs):
            # a flat tuple of tensors: unpack in one statement
            lhs = [x.name if x.name in newset else "_" for x in op.outs]
            lines.append(", ".join(lhs) + (", = " if len(lhs) == 1 else " = ") + call)
            bind_src = None
        else:
            lines.append(f"_o = {call}")
            bind_src = "_o"
        if bind_src is not None:
            for path, ref in paths:
                if ref.name in newset:
                    lines.append(f"{ref.name} = {bind_src}{path}")
        issued = _functional(op) and op.func is not _WAIT
        for n in op.new:
            copies = []
            if spills and n in spills:
                copies.append(f"{prog.const(spills[n], 'p')}.copy_({n})")
            if n in static_names:
                copies.append(f"{static_names[n]}.copy_({n})")
            if issued:  # not written yet: refreshed after its wait
                unwaited[n] = copies
                ref_expr[n] = n
                continue
            lines.extend(copies)
            if n in static_names:
                ref_expr[n] = static_names[n]
                lines.append(f"del {n}")
            else:
                ref_expr[n] = n
        if op.func is _WAIT:
            for n in {cn(m) for m in op.in_names} & unwaited.keys():
                waited(n)
        # (a collective's result not waited yet stays bound until its wait)
        dead = [
            cn(n)
            for n in set(op.in_names)
            if last_use.get(cn(n)) == i and ref_expr.get(cn(n)) == cn(n) and cn(n) not in unwaited
        ]
        dead += [n for n in op.new if ref_expr[n] == n and n not in last_use and n not in unwaited]
        if dead:
            lines.append("del " + ", ".join(sorted(set(dead))))
        if bind_src == "_o":
            lines.append("del _o")
    for n in list(unwaited):
        prog.lines.append(f"{prog.const(_WAIT, 'f')}({n})")
        waited(n)
        if ref_expr.get(n) == n:
            prog.lines.append(f"del {n}")
    prog.fn = prog.build()
    return prog, n_ops


class _Plan:
    """Where results go: ``out`` maps an op index to the buffer it writes
    (``out=``), ``views`` a planned name to {view name: view of its buffer},
    ``direct`` an op index to the ``(kernel binding, args, out view)`` its
    composite call collapses to (:mod:`~graphrunner.tape.collapse`)."""

    def __init__(self):
        self.out: dict[int, torch.Tensor] = {}
        self.views: dict[str, dict[str, torch.Tensor]] = {}
        self.direct: dict[int, tuple] = {}
        self.allocated = 0  # distinct temporary buffers allocated (the next one's scratch index)


def plan_buffers(
    cap, ops, keep, cn, survivors: dict, surv_storages: set, spills: dict, consts: dict | None = None, scratch=None
) -> _Plan:
    """Give each replayed op whose binding was verified with ``out=``
    (``op.out_ok``) a buffer allocated once, so that replay does no allocator
    traffic, and turn views of those buffers (``op.view``) into constants.

    A survivor's op writes into the survivor itself (no refresh copy).  A
    temporary gets a buffer of its exact metadata, reused (same dtype, shape,
    strides) once every tensor on the previous holder's storage is dead: the
    buffer is freed after the last op reading any name on that storage, and
    an op's own output is taken before its inputs are freed, so a buffer
    never aliases a live value or an input of the op writing it. With
    ``scratch`` (``TapePool.scratch``: ``(j, nbytes, device) -> storage``) the
    ``j``-th buffer allocated is a view of that storage, shared with the other
    graphs of the pool; without it, memory of its own.  Temporaries
    that another graph's memory spills to, and every op after an in-place
    metadata change (``set_``, ``resize_``), are left to the allocator.

    A composite call whose arguments are all fixed tensors (``consts``, the
    externals and constants by name, or earlier buffers and their views)
    collapses to its kernel (``plan.direct``); a functional composite
    (``linear`` with a bias, which has no same-kernel ``out=`` form) gets a
    buffer only then."""
    plan = _Plan()
    if cap.meta_mutated:
        return plan
    fixed: dict[str, torch.Tensor] = {cn(n): t for n, t in (consts or {}).items()}

    def fixed_args(op):
        cargs, ckwargs = op.cargs
        if ckwargs:
            return None
        got = [fixed.get(cn(a.name)) if isinstance(a, Ref) else a for a in cargs]
        return got if all(isinstance(t, torch.Tensor) for t in got) else None

    def seen(op, targs) -> dict:
        """{id(arg): value it held at capture, or None} for the temporaries
        among ``targs`` (their buffers hold nothing yet), for the proof."""
        kept = op.seen or {}
        return {
            id(t): kept.get(a.name)
            for a, t in zip(op.cargs[0], targs)
            if isinstance(a, Ref) and cap.kind.get(a.name) == "int"
        }

    last: dict[int, int] = {}  # storage key -> index of the last kept op using it
    for i, op in enumerate(ops):
        if keep[i]:
            for n in list(op.in_names) + list(op.writes):
                k = cap.skey.get(cn(n))
                if k is not None:
                    last[k] = i
    # A functional collective may read its input until its wait (gloo's all_gather / reduce_scatter read it
    # on their own thread): the input's buffer is not reused before then.
    for i, op in enumerate(ops):
        if keep[i] and _functional(op) and op.func is not _WAIT:
            until = _wait_index(ops, keep, i, cn)
            for n in op.in_names:
                k = cap.skey.get(cn(n))
                if k is not None:
                    last[k] = max(last.get(k, i), until)
    free: dict[tuple, list] = {}
    held: dict[int, tuple] = {}  # storage key -> (free-list key, buffer) of a planned temporary
    release_at: dict[int, list] = {}
    for i, op in enumerate(ops):
        if not keep[i]:
            continue
        if op.view is not None and op.view[0] in plan.views:
            base, size, stride, offset = op.view
            k = cap.skey.get(base)
            with torch.inference_mode(cap.inference):
                v = plan.views[base][op.new[0]] = held[k][1].as_strided(size, stride, offset)
            fixed[op.new[0]] = v
        elif (
            (op.out_ok or op.call in COLLAPSIBLE_FUNCTIONAL)
            and op.call is not None
            and not op.collective
            and isinstance(op.outs, Ref)
        ):
            n = op.outs.name
            k = cap.skey.get(n)
            meta = cap.alloc_meta.get(n)
            functional = None
            if not op.out_ok:  # planned only as its kernel
                targs = fixed_args(op)
                functional = targs and collapse_functional(op.call, targs, cap.inference, seen(op, targs), cap.tls)
                if not functional:
                    meta = None
            if n in op.new and meta is not None and n not in spills and cap.owns_storage(n):
                if n in survivors:
                    t = survivors[n]
                    if (t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset()) == meta:
                        plan.out[i] = t
                elif k not in surv_storages:
                    fk = meta + (cap.inference,)
                    lst = free.get(fk)
                    if lst:
                        buf = lst.pop()
                    else:
                        dtype, device, size, stride, _ = meta
                        with torch.inference_mode(cap.inference):
                            if scratch is None:
                                buf = torch.empty_strided(size, stride, dtype=dtype, device=device)
                            else:
                                st = scratch(plan.allocated, extent(meta), device)
                                buf = torch.empty(0, dtype=dtype, device=device).set_(st, 0, size, stride)
                        plan.allocated += 1
                    plan.out[i] = buf
                    plan.views[n] = {}
                    held[k] = (fk, buf)
                    release_at.setdefault(_release_after(i, last.get(k, i)), []).append(k)
                buf = plan.out.get(i)
                if buf is not None:
                    fixed[n] = buf
                    if functional:
                        plan.direct[i] = (functional[0], functional[1], view_like(buf, functional[2]))
                    elif op.call in COLLAPSIBLE and (targs := fixed_args(op)) is not None:
                        direct = collapse(op.call, targs, buf, seen(op, targs), cap.tls)
                        if direct is not None:
                            plan.direct[i] = direct
        for k in release_at.pop(i, ()):
            fk, buf = held[k]
            free.setdefault(fk, []).append(buf)
    return plan


#: ``_c10d_functional.wait_tensor`` (None without torch.distributed: then no functional collective is recorded)
_WAIT = torch.ops._c10d_functional.wait_tensor.default if torch.distributed.is_available() else None


def _functional(op: RecordedOp) -> bool:
    """Whether ``op`` is a functional collective (its result is written until a ``wait_tensor`` on it)."""
    return op.collective and op.func.namespace in FUNCTIONAL_COLLECTIVES


def _wait_index(ops, keep, i: int, cn) -> int:
    """Index of the first kept ``wait_tensor`` on a result of the functional collective ``ops[i]`` (past the
    last op when none: its result is waited at the end of the replay)."""
    mine = {cn(n) for n in ops[i].new}
    for j in range(i + 1, len(ops)):
        if keep[j] and ops[j].func is _WAIT and any(cn(n) in mine for n in ops[j].in_names):
            return j
    return len(ops)


def _release_after(i: int, last_use: int) -> int:
    """Index of the op after which a buffer taken by op ``i`` is free again:
    the last op reading its storage (never before ``i`` itself)."""
    return max(i, last_use)


def _key(v, cn):
    """Hashable form of an argument template (names through ``cn``); floats by
    repr so that 0.0 / -0.0 and NaNs stay distinct.  TypeError if unhashable."""
    if isinstance(v, Ref):
        return ("R", cn(v.name))
    if isinstance(v, float):
        return ("F", repr(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_key(x, cn) for x in v)
    if isinstance(v, dict):
        return ("D",) + tuple((k, _key(x, cn)) for k, x in v.items())
    hash(v)
    return (type(v).__name__, v)


def _ref_paths(v, path=""):
    if isinstance(v, Ref):
        yield path, v
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _ref_paths(x, f"{path}[{i}]")


def _work_paths(v, path=""):
    # outputs of c10d ops that are not tensors are Work objects (recorded as None)
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if x is None:
                yield f"{path}[{i}]"
            elif isinstance(x, (list, tuple)):
                yield from _work_paths(x, f"{path}[{i}]")
