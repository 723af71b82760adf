"""Complex-valued rotary embeddings in real arithmetic (used by `export`).

Some models rotate queries and keys with complex numbers: `torch.polar(ones, angles)` makes the
rotations, `torch.view_as_complex` pairs up the last dim of q and k, a complex multiply rotates
them and `torch.view_as_real(...).flatten(...)` brings them back (Llama 4, DeepSeek-V2). ONNX
has no complex tensors and the exporter stops at the first one. While the export traces, a
torch function mode (`RealComplex`) carries every complex value as a `Complex`: its real and
imaginary parts, two real tensors of the same shape, on which the ops rotary uses act as they
act on complex tensors — the same result in f64, every op a real one the graph can hold. The
mode is chosen by what the module computes (the first complex op it meets), not by its class.
A complex op this does not cover stops the export with `ComplexOpError`, naming the op and the
module that called it."""

from __future__ import annotations

from typing import Any, Callable

from .errors import SmpError

_COMPLEX_OF = {"float16": "complex32", "float32": "complex64", "float64": "complex128"}


class ComplexOpError(SmpError):
    """A complex-valued op the real-arithmetic export does not cover."""


class Complex:
    """A complex tensor as two real tensors, `re` and `im`, of its shape."""

    __slots__ = ("re", "im", "_mode")

    def __init__(self, re: Any, im: Any, mode: "RealComplex") -> None:
        self.re, self.im, self._mode = re, im, mode

    # what code reads of a tensor
    @property
    def shape(self) -> Any:
        return self.re.shape

    @property
    def device(self) -> Any:
        return self.re.device

    @property
    def dtype(self) -> Any:
        import torch

        return getattr(torch, _COMPLEX_OF.get(str(self.re.dtype).removeprefix("torch."), "complex64"))

    @property
    def ndim(self) -> int:
        return self.re.dim()

    @property
    def real(self) -> Any:
        return self.re

    @property
    def imag(self) -> Any:
        return self.im

    def dim(self) -> int:
        return self.re.dim()

    def size(self, *d: int) -> Any:
        return self.re.size(*d)

    def is_complex(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.re)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        mode = next((a._mode for a in _flat(args, kwargs) if isinstance(a, Complex)), None)
        if mode is None:  # pragma: no cover - torch only calls this with a Complex among the arguments
            return NotImplemented
        return mode.apply(func, args, kwargs or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocol probes (hasattr) find nothing
            raise AttributeError(name)
        # a tensor method this class does not define: refused by name
        raise self._mode.refuse(f"Tensor.{name}")

    def __mul__(self, o: Any) -> Any: return self._mode.method("mul", self, o)
    def __rmul__(self, o: Any) -> Any: return self._mode.method("mul", self, o)
    def __add__(self, o: Any) -> Any: return self._mode.method("add", self, o)
    def __radd__(self, o: Any) -> Any: return self._mode.method("add", self, o)
    def __sub__(self, o: Any) -> Any: return self._mode.method("sub", self, o)
    def __rsub__(self, o: Any) -> Any: return self._mode.method("rsub", self, o)
    def __neg__(self) -> Any: return self._mode.method("neg", self)
    def __getitem__(self, i: Any) -> Any: return self._mode.method("getitem", self, i)

    def mul(self, o: Any) -> Any: return self._mode.method("mul", self, o)
    def add(self, o: Any) -> Any: return self._mode.method("add", self, o)
    def sub(self, o: Any) -> Any: return self._mode.method("sub", self, o)
    def conj(self) -> Any: return self._mode.method("conj", self)
    def abs(self) -> Any: return self._mode.method("abs", self)
    def angle(self) -> Any: return self._mode.method("angle", self)
    def to(self, *a: Any, **k: Any) -> Any: return self._mode.method("to", self, *a, **k)
    def type_as(self, o: Any) -> Any: return self._mode.method("type_as", self, o)
    def reshape(self, *a: Any) -> Any: return self._mode.method("reshape", self, *a)
    def view(self, *a: Any) -> Any: return self._mode.method("view", self, *a)
    def flatten(self, *a: Any, **k: Any) -> Any: return self._mode.method("flatten", self, *a, **k)
    def unsqueeze(self, d: int) -> Any: return self._mode.method("unsqueeze", self, d)
    def squeeze(self, *a: Any) -> Any: return self._mode.method("squeeze", self, *a)
    def transpose(self, a: int, b: int) -> Any: return self._mode.method("transpose", self, a, b)
    def permute(self, *a: Any) -> Any: return self._mode.method("permute", self, *a)
    def expand(self, *a: Any) -> Any: return self._mode.method("expand", self, *a)
    def repeat(self, *a: Any) -> Any: return self._mode.method("repeat", self, *a)
    def contiguous(self, *a: Any, **k: Any) -> Any: return self
    def clone(self, *a: Any, **k: Any) -> Any: return self._mode.method("clone", self)
    def detach(self) -> Any: return self._mode.method("detach", self)
    def float(self) -> Any: return self._mode.method("float", self)
    def double(self) -> Any: return self._mode.method("double", self)
    def chunk(self, *a: Any, **k: Any) -> Any: return self._mode.method("chunk", self, *a, **k)
    def split(self, *a: Any, **k: Any) -> Any: return self._mode.method("split", self, *a, **k)

    def __repr__(self) -> str:
        return f"Complex(shape={tuple(self.shape)}, parts={self.re.dtype})"


def _flat(args: Any, kwargs: Any = None) -> list[Any]:
    out: list[Any] = []
    stack = [args, kwargs or {}]
    while stack:
        x = stack.pop()
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            out.append(x)
    return out


def _name(func: Any) -> str:
    """`mul` for torch.mul, Tensor.mul, Tensor.__mul__; `rmul` for Tensor.__rmul__."""
    name = getattr(func, "__name__", str(func))
    return name[2:-2] if name.startswith("__") and name.endswith("__") else name


def _real_dtype(dtype: Any) -> Any:
    """The parts' dtype of a complex dtype (or `dtype` itself when real)."""
    import torch

    return {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)


# ops that act on both parts alike: name -> how to call it on one part
_SHAPE_OPS = {"reshape", "view", "flatten", "unsqueeze", "squeeze", "transpose", "permute", "expand", "repeat",
              "getitem", "clone", "detach", "contiguous", "narrow", "select", "movedim", "swapaxes"}


class RealComplex:
    """The torch function mode of the module docs. `where` names the module being traced
    (for refusals). Entered as a context manager around the traced forward."""

    def __init__(self, where: Callable[[], str] = lambda: "") -> None:
        self.where = where
        self._mode: Any = None
        #: Whether the traced forward met a complex value.
        self.used = False

    # -- the mode
    def __enter__(self) -> "RealComplex":
        from torch.overrides import TorchFunctionMode

        owner = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                return owner.apply(func, args, kwargs or {})

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    def refuse(self, op: str) -> ComplexOpError:
        where = self.where()
        return ComplexOpError(
            f"`{op}` on a complex tensor" + (f" in module {where}" if where else "")
            + " cannot be exported: ONNX has no complex tensors, and the export carries complex values in real "
              "arithmetic only through the ops complex rotary embeddings use (view_as_complex, polar, complex, "
              "view_as_real, real/imag, multiply, add, conj, and reshaping); compute it on real tensors (e.g. the "
              "cos/sin form of rotary) or keep it out of the exported forward")

    def _pair(self, re: Any, im: Any) -> Complex:
        self.used = True
        return Complex(re, im, self)

    # -- torch functions
    def apply(self, func: Any, args: tuple, kwargs: dict) -> Any:
        import torch

        name = _name(func)
        if func is torch.view_as_complex:
            (x,) = args
            if x.shape[-1] != 2:
                raise self.refuse("torch.view_as_complex (last dim not 2)")
            return self._pair(x.select(-1, 0), x.select(-1, 1))
        if func is torch.polar or func is torch.complex:
            first, second = ("abs", "angle") if func is torch.polar else ("real", "imag")
            bound = {**dict(zip((first, second), args)), **kwargs}
            a, b = bound[first], bound[second]
            return self._pair(a * torch.cos(b), a * torch.sin(b)) if func is torch.polar else self._pair(a, b)
        if any(isinstance(a, Complex) for a in _flat(args, kwargs)):
            if name in ("view_as_real",):
                (x,) = args
                return torch.stack((x.re, x.im), dim=-1)
            if name in ("real", "imag") and isinstance(args[0], Complex) and len(args) == 1:
                return args[0].re if name == "real" else args[0].im
            if name in ("stack", "cat"):
                parts = args[0]
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                parts = [p if isinstance(p, Complex) else self._pair(p, torch.zeros_like(p)) for p in parts]
                return self._pair(func([p.re for p in parts], dim), func([p.im for p in parts], dim))
            first = next(a for a in args if isinstance(a, Complex)) if any(isinstance(a, Complex) for a in args) \
                else None
            if first is None:
                raise self.refuse(f"torch.{name}")
            rest = [a for a in args if a is not first]
            if name == "rmul":
                name = "mul"
            if name == "sub" and args[0] is not first:
                name = "rsub"
            return self.method(name, first, *rest, **kwargs)
        out = func(*args, **kwargs)
        for t in _flat(out):
            if isinstance(t, torch.Tensor) and t.is_complex():
                raise self.refuse(f"torch.{name} (a complex result)")
        return out

    # -- ops on a Complex
    def method(self, name: str, z: Complex, *args: Any, **kwargs: Any) -> Any:
        import torch

        def parts(o: Any) -> tuple[Any, Any]:
            """`o` as (re, im): a Complex, a real tensor or a Python number."""
            if isinstance(o, Complex):
                return o.re, o.im
            if isinstance(o, complex):
                return o.real, o.imag
            if isinstance(o, torch.Tensor) and o.is_complex():
                raise self.refuse(f"Tensor.{name} with a complex tensor made outside the export")
            return o, None

        if name in _SHAPE_OPS:
            op = (lambda t: t[args[0]]) if name == "getitem" else (lambda t: getattr(t, name)(*args, **kwargs))
            return self._pair(op(z.re), op(z.im))
        if name in ("chunk", "split", "unbind"):
            res, ims = getattr(z.re, name)(*args, **kwargs), getattr(z.im, name)(*args, **kwargs)
            return tuple(self._pair(r, i) for r, i in zip(res, ims))
        if name in ("mul", "add", "sub", "rsub"):
            (o,) = args
            c, d = parts(o)
            if name == "mul":
                if d is None:
                    return self._pair(z.re * c, z.im * c)
                return self._pair(z.re * c - z.im * d, z.re * d + z.im * c)
            sign = -1 if name == "rsub" else 1
            other_sign = -1 if name == "sub" else 1
            re = sign * z.re + other_sign * c
            im = sign * z.im + (other_sign * d if d is not None else 0)
            return self._pair(re, im)
        if name == "neg":
            return self._pair(-z.re, -z.im)
        if name == "conj":
            return self._pair(z.re, -z.im)
        if name == "abs":
            return torch.sqrt(z.re * z.re + z.im * z.im)
        if name == "angle":
            return torch.atan2(z.im, z.re)
        if name in ("float", "double"):
            return self._pair(getattr(z.re, name)(), getattr(z.im, name)())
        if name == "type_as":
            (o,) = args
            if isinstance(o, Complex):
                return self._pair(z.re.type_as(o.re), z.im.type_as(o.im))
            raise self.refuse("Tensor.type_as (a complex tensor as a real dtype)")
        if name == "to":
            target = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.dtype)), None)
            if target is not None and not target.is_complex:
                raise self.refuse(f"Tensor.to({target}) (a complex tensor cast to a real dtype)")
            rest = [(_real_dtype(a) if isinstance(a, torch.dtype) else a) for a in args]
            kw = {k: (_real_dtype(v) if isinstance(v, torch.dtype) else v) for k, v in kwargs.items()}
            return self._pair(z.re.to(*rest, **kw), z.im.to(*rest, **kw))
        raise self.refuse(f"Tensor.{name}")
