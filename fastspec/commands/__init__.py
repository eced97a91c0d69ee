"""The ``fastspec`` sub-commands, one module each; :mod:`fastspec.cli` dispatches to them.

Each module is thin: ``add_arguments(parser)`` declares the command's flags and ``run(args) ->
int`` checks them, calls the library (the capability package that does the work: ``fastspec.bench``
for ``bench`` and ``compare``, ``fastspec.demo``, ``fastspec.report``, ``fastspec.eig`` for
``precompile``) and prints. A module imports nothing heavy at its top, so that its ``--help``
stays cheap; :mod:`fastspec.cli` lists the commands without importing any of them.

Bad input: ``run`` raises ValueError whose one-line message starts with the flag it is about;
:func:`fastspec.cli.main` prints it as a usage error and returns 2.
"""
