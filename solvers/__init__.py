"""Not a package: this folder holds the package `itde_solvers`.

Without this file the folder would be importable as a namespace package `solvers`
whenever its parent is on `sys.path`, and `solvers.itde_solvers` would be a second copy
of `itde_solvers` whose classes fail `isinstance` checks against the first.
"""

raise ImportError(
    "`solvers` is the folder that holds the package `itde_solvers`, not a package itself: "
    "write `import itde_solvers` (and put this folder, not its parent, on the path)."
)
