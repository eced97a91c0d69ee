"""Where the commands write (:func:`fastspec._paths.unwritable`): the check lives in the library,
which ``fastspec analyze``'s loop uses too; the commands import it from here, as before."""
from .._paths import unwritable

__all__ = ["unwritable"]
