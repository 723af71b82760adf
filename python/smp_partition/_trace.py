"""Which module the export is tracing (used by `export` for its messages): a stack of the
modules whose forward has begun and not returned, kept by global forward hooks while the
export runs. When the trace fails inside a forward, its post-hook never runs, so the top of
the stack is the innermost module at the failure."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


class ModuleStack:
    """The modules of `root` being run, innermost last, by their names in `root` without
    `strip` (the export wrapper's attribute)."""

    def __init__(self, root: Any, strip: str = "") -> None:
        self.names = {id(m): (n[len(strip):] if n.startswith(strip) else n) for n, m in root.named_modules()}
        self.stack: list[Any] = []
        #: The innermost module when the last forward failed (kept after the stack unwinds).
        self.failed_in: Any = None

    def innermost(self, modules: list[Any] | None = None) -> str:
        """`name` (Class) of the innermost running module of `root`, or '' when none is."""
        for m in reversed(self.stack if modules is None else modules):
            name = self.names.get(id(m))
            if name is not None:
                return f"`{name}` ({type(m).__name__})" if name else f"{type(m).__name__} (the model itself)"
        return ""

    def where_failed(self) -> str:
        """`innermost()` at the moment the first traced forward failed."""
        return self.innermost(self.failed_in) if self.failed_in else ""

    @contextlib.contextmanager
    def running(self) -> Iterator["ModuleStack"]:
        """Registers the hooks for the duration of the block."""
        import torch

        def pre(module: Any, args: Any) -> None:
            self.stack.append(module)

        def post(module: Any, args: Any, output: Any) -> None:
            # a forward that raised skips this hook, so the stack still holds where it failed
            if self.stack and self.stack[-1] is module:
                self.stack.pop()

        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                 torch.nn.modules.module.register_module_forward_hook(post)]
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
            self.stack.clear()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the traced forward: keeps the stack where it first fails (the exporter
        raises its first attempt's error), and starts each attempt on an empty stack."""
        self.stack.clear()
        try:
            yield
        except BaseException:
            if self.failed_in is None:
                self.failed_in = list(self.stack)
            raise
        finally:
            self.stack.clear()


#: Exception classes (by name) of a shape or branch the exporter could not decide symbolically.
_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException",
                   "PendingUnbackedSymbolNotFound", "ConstraintViolationError")


def causes(e: BaseException) -> list[BaseException]:
    """`e` and its causes (`__cause__`, else `__context__`), outermost first."""
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return out


def is_data_dependent(e: BaseException) -> bool:
    """Whether the export failed on a shape or branch it could not decide symbolically (a
    data-dependent value, or a guard that specialises a symbolic dim)."""
    for x in causes(e):
        text = str(x)
        if type(x).__name__ in _DATA_DEPENDENT or "data-dependent" in text or "Constraints violated" in text:
            return True
    return False


def _source_line(e: BaseException) -> str:
    """`file:line` and the code of the deepest frame of `e`'s traceback outside torch and
    this package (the model's own code), or ''."""
    import linecache
    import os
    import traceback

    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    best = ""
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename.startswith(skip) or frame.filename.startswith("<"):
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        best = f"{os.path.basename(frame.filename)}:{frame.lineno} `{code}`"
    return best


def construct(e: BaseException) -> str:
    """What the exporter stopped on, in a phrase, with the model's code line where known."""
    import re

    chain = causes(e)
    inner = chain[-1]
    for x in chain:
        if type(x).__name__ in _DATA_DEPENDENT or "data-dependent" in str(x):
            inner = x
            break
    text = str(inner)
    m = re.search(r"data-dependent expression (.+?)(?: \(unhinted|\.\s|\n|$)", text)
    if m:
        what = f"a shape or condition that depends on tensor values (`{m.group(1).strip()}`)"
    elif "Constraints violated" in text or type(inner).__name__ == "ConstraintViolationError":
        what = "a condition on the symbolic sequence or batch length that not every length satisfies"
    else:
        first = (text.strip().splitlines() or [""])[0]
        what = f"{type(inner).__name__}: {first[:300]}"
    line = ""
    for x in reversed(chain):
        line = _source_line(x)
        if line:
            break
    return what + (f" at {line}" if line else "")
