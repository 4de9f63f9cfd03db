"""Whether Triton is installed: the one import error that turns the Triton paths off (macOS, Windows and
CPU-only installs run the torch ops) rather than surfacing."""


def triton_missing(err: ModuleNotFoundError) -> bool:
    """Is this the import error of triton itself (not installed: macOS, Windows, CPU-only installs), as
    opposed to a missing module inside the engine, which must surface?"""
    return err.name == "triton"
