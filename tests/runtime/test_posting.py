"""The poster thread: posts run in submission order; waits go to the posted work."""

from __future__ import annotations

import datetime
import threading

from pipeline.runtime.posting import Poster

__all__: list[str] = []


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def wait(self, timeout: datetime.timedelta) -> None:
        self.log.append(f"wait {self.name}")
        self.done = True

    def is_completed(self) -> bool:
        return self.done


def test_posts_run_in_order_on_one_other_thread_and_waits_reach_the_work() -> None:
    poster = Poster()
    log: list[str] = []
    threads: set[int] = set()

    def post(name: str) -> _Work:
        threads.add(threading.get_ident())
        log.append(f"post {name}")
        return _Work(log, name)

    posted = [poster.submit(lambda n=name: post(n)) for name in "abcde"]
    posted[2].wait(datetime.timedelta(seconds=30))
    poster.close()
    assert [entry for entry in log if entry.startswith("post")] == [f"post {n}" for n in "abcde"]
    assert "wait c" in log
    assert threads and threading.get_ident() not in threads and len(threads) == 1
    assert posted[2].is_completed() and not posted[0].is_completed()
