"""A process whose watchdog board is in a store call while the interpreter exits (tests/test_store_calls.py).

argv: the port of a TCPStore server, and that server's pid. Connected, the probe stops the server (SIGSTOP), and a
daemon thread reads the heartbeats: the call waits inside torch's C++ TCPStore, GIL released, for an answer. The main
thread then ends. During the interpreter's finalization a module global's __del__ lets the server go on (SIGCONT)
and waits 2 s: the answer comes, and the call returns in the middle of finalization. Without
mgpu.stop.store_calls' exit (which shuts the connection down, before finalization, and waits for the call), CPython
ends that thread with pthread_exit, and the forced unwind through torch's C++ frames aborts the process (SIGABRT)."""

import os
import signal
import sys
import threading
import time

from mgpu.stop.heartbeat_board import StoreBoard

SERVER = int(sys.argv[2])


class LateAnswer:
    def __del__(self, kill=os.kill, cont=signal.SIGCONT, server=SERVER, sleep=time.sleep) -> None:
        kill(server, cont)  # (all bound now: the module's globals are gone by then)
        sleep(2)


def read(board: StoreBoard, entered: threading.Event) -> None:
    entered.set()
    try:
        board.read(2)
    except Exception:  # noqa: BLE001  (a connection shut down, a refusal at exit: the watchdog takes either)
        pass


board = StoreBoard.connect("127.0.0.1", int(sys.argv[1]), "probe", timeout_s=2)
board.publish(0, "connected")
os.kill(SERVER, signal.SIGSTOP)  # alive, not answering
entered = threading.Event()
threading.Thread(target=read, args=(board, entered), daemon=True).start()
entered.wait()
time.sleep(0.3)  # the thread is inside the call now
keep = LateAnswer()
print("main thread done", flush=True)
