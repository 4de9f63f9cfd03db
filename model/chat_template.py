"""Chat templates, rendered as transformers renders them (jinja2's immutable sandbox, trim_blocks and
lstrip_blocks, raise_exception(), a tojson that keeps non-ASCII text), in a separate process bounded in wall
time, memory and output.

A checkpoint's template is untrusted input. The sandbox keeps it away from Python's internals; the process
bounds whatever it calls, jinja2's globals and filters included (lipsum, wordwrap, a string doubled with ~,
a loop that never ends): past TEMPLATE_SECONDS the process is killed, past TEMPLATE_MEMORY_BYTES of new memory
an allocation fails (where the OS enforces an address-space limit: Linux), and past TEMPLATE_MAX_CHARS of
output the rendering stops. One renderer process serves every template of this Python process: it starts
in the background when a checkpoint with a chat template loads, keeps the templates it has compiled, and
renders a normal template in a fraction of a millisecond; one stopped at a bound is replaced by a fresh one.

The renderer imports only the standard library and jinja2 (this module is all it loads), so it starts fast.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

TEMPLATE_SECONDS = 2.0  # one render's wall time, compiling included
TEMPLATE_MEMORY_BYTES = 256 * 2**20  # what one render may allocate beyond the renderer's own start-up memory
TEMPLATE_MAX_CHARS = 4 * 2**20  # the rendered prompt's length
START_SECONDS = 60.0  # the renderer's start-up (an interpreter and jinja2), on a loaded machine

_ROOT = Path(__file__).resolve().parent.parent
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); from model.chat_template import serve; "
         "serve(int(sys.argv[2]))")
_HEADER = struct.Struct(">cI")  # a reply's kind and its payload's length
_READY, _OK, _FAILED, _OUT_OF_MEMORY, _TOO_LONG = b"R", b"o", b"e", b"m", b"s"


def render_chat_template(source: str, context: dict[str, Any], origin: str) -> str:
    """The template rendered with `context` in the renderer process. ValueError naming the template
    (`origin`, where it comes from) and, for a template stopped at a bound, the bound."""
    return _renderer.render(source, context, origin)


def start_renderer() -> None:
    """Start the renderer process in the background if it is not running, so that the first render does
    not wait for it. A failure to start is reported by the first render."""
    try:
        with _renderer.lock:
            _renderer.ensure_started()
    except OSError:
        pass


class _Renderer:
    """The parent's side: one renderer process, its replies read by a thread into a queue (a pipe read with a
    timeout the portable way), one render at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = False
        self.owner = 0  # the pid that started the process: a forked child starts its own

    def ensure_started(self) -> None:
        process = self.process
        if process is not None and self.owner == os.getpid() and process.poll() is None:
            return
        self.stop()
        command = [sys.executable, "-c", _BOOT, str(_ROOT), str(TEMPLATE_MEMORY_BYTES)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL)
        self.owner, self.ready, self.replies = os.getpid(), False, queue.SimpleQueue()
        threading.Thread(target=_read_replies, args=(self.process.stdout, self.replies), daemon=True,
                         name="chat-template-replies").start()

    def stop(self) -> None:
        """Kill this process's renderer (never one a forked parent started)."""
        process, self.process = self.process, None
        if process is not None and self.owner == os.getpid():
            process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                pipe.close()

    def render(self, source: str, context: dict[str, Any], origin: str) -> str:
        try:
            request = pickle.dumps((source, context, TEMPLATE_MAX_CHARS), pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            raise ValueError(f"chat template {origin}: its variables must be plain data (strings, numbers, "
                             f"lists, dicts) to reach the sandboxed renderer: {type(err).__name__}: {err}") \
                from None
        with self.lock:
            try:
                self.ensure_started()
            except OSError as err:
                raise ValueError(f"chat template {origin}: cannot start the renderer process "
                                 f"({sys.executable}): {err}") from None
            try:
                if not self.ready:
                    self.wait(START_SECONDS, origin, "starting the renderer process",
                              f"is jinja2 installed for {sys.executable}?")
                    self.ready = True
                self.process.stdin.write(struct.pack(">I", len(request)) + request)
                self.process.stdin.flush()
                kind, text = self.wait(TEMPLATE_SECONDS, origin, "rendering",
                                       f"a template that exhausts its memory ({TEMPLATE_MEMORY_BYTES} bytes) "
                                       "can end it so")
            except BaseException:  # a bound was hit, or the caller was interrupted: no reply is left behind
                self.stop()
                raise
            if kind == _OUT_OF_MEMORY:
                self.stop()  # a fresh process for the next template, whatever the failed allocation left
        if kind == _OK:
            return text
        if kind == _OUT_OF_MEMORY:
            raise ValueError(f"chat template {origin}: rendering needed more than {TEMPLATE_MEMORY_BYTES} "
                             "bytes of memory (the bound on a chat template's memory)")
        if kind == _TOO_LONG:
            raise ValueError(f"chat template {origin}: its output exceeds {TEMPLATE_MAX_CHARS} characters "
                             "(the bound on a rendered chat template)")
        raise ValueError(f"chat template {origin}: {text}")

    def wait(self, seconds: float, origin: str, doing: str, if_died: str) -> tuple[bytes, str]:
        """The next reply within `seconds`; ValueError naming the bound on a timeout, or saying `if_died` if
        the process died."""
        try:
            kind, text = self.replies.get(timeout=seconds)
        except queue.Empty:
            raise ValueError(f"chat template {origin}: {doing} took longer than {seconds} s (the bound on a "
                             "chat template's wall time); the renderer process was stopped") from None
        if kind is None:
            code = self.process.wait()
            raise ValueError(f"chat template {origin}: the renderer process exited (code {code}) while "
                             f"{doing}; {if_died}")
        return kind, text


def _read_replies(pipe: IO[bytes], replies: queue.SimpleQueue) -> None:
    """Read the renderer's replies into the queue until its output closes; then (None, "")."""
    try:
        while True:
            header = pipe.read(_HEADER.size)
            if len(header) < _HEADER.size:
                break
            kind, length = _HEADER.unpack(header)
            payload = pipe.read(length)
            if len(payload) < length:
                break
            replies.put((kind, payload.decode("utf-8", errors="replace")))
    except (OSError, ValueError):  # the pipe was closed under us (stop())
        pass
    replies.put((None, ""))


_renderer = _Renderer()
atexit.register(_renderer.stop)


# -- the renderer process -----------------------------------------------------------------------------

def serve(memory_bytes: int) -> None:
    """The renderer process's loop: read a request (length, then a pickle of source, context and the output
    bound) from stdin, render it, write the reply to stdout; until stdin closes. Its address space may grow
    by memory_bytes past its start-up. Ctrl-C is the parent's to handle, so it is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    environment = template_environment()
    compiled: dict[str, Any] = {}
    _limit_memory(memory_bytes)
    _reply(out, _READY, "")
    while True:
        size = inp.read(4)
        if len(size) < 4:
            return
        source, context, max_chars = pickle.loads(inp.read(struct.unpack(">I", size)[0]))
        try:
            template = compiled.get(source)
            if template is None:
                if len(compiled) >= 16:  # templates passed per call: keep the cache small
                    compiled.clear()
                template = compiled[source] = environment.from_string(source)
            kind, text = _OK, _render(template, context, max_chars)
        except MemoryError:
            kind, text = _OUT_OF_MEMORY, ""
        except _TooLong:
            kind, text = _TOO_LONG, ""
        except Exception as err:  # jinja2's errors, and whatever the template's own calls raise
            kind, text = _FAILED, f"{type(err).__name__}: {err}"
        _reply(out, kind, text)


class _TooLong(Exception):
    pass


def template_environment():
    """transformers' template environment: jinja2's immutable sandbox, trim_blocks and lstrip_blocks,
    raise_exception() and a tojson filter that keeps non-ASCII text."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                          indent=indent)
    return environment


def _render(template, context: dict[str, Any], max_chars: int) -> str:
    """Render chunk by chunk, stopping past max_chars of output."""
    chunks, size = [], 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > max_chars:
            raise _TooLong
        chunks.append(chunk)
    return "".join(chunks)


def _reply(out: IO[bytes], kind: bytes, text: str) -> None:
    payload = text.encode("utf-8", errors="replace")
    out.write(_HEADER.pack(kind, len(payload)) + payload)
    out.flush()


def _limit_memory(extra: int) -> None:
    """Let this process's address space grow by at most `extra` bytes past what it holds now, where the OS
    says what that is and enforces the limit (Linux); elsewhere only the time and output bounds hold."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = used + extra if hard == resource.RLIM_INFINITY else min(used + extra, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError, AttributeError):
        pass
