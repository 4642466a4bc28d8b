"""Triton 3.6's interpreter (TRITON_INTERPRET=1, how the tests run the kernels on CPU) with
numpy >= 2.4: a loop bound that is a runtime scalar (`for start in range(lo, hi, TILE_N)`)
fails, because the interpreter turns its one-element array into an int with `int(array)`, which
numpy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6). `apply()` makes that conversion
take the element itself. It changes only what the interpreter patches onto `tl.tensor` while a
kernel runs; compiled kernels never go through it. A no-op where the interpreter is laid out
differently (a Triton that has the fix).
"""

from __future__ import annotations

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
