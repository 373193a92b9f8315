"""The result line of a script run under mpirun: printed, and where CT_TEST_OUT names a folder,
also added to that folder's file of this process (mpirun's forwarding of the processes'
output may merge their lines), which the pytest wrappers read."""
import os
import sys


def report(me: int, line: str) -> None:
    print(line, flush=True)
    if os.environ.get("CT_TEST_OUT"):
        with open(os.path.join(os.environ["CT_TEST_OUT"], str(me)), "a") as f:
            f.write(line + "\n")


def finish(dist, me: int, n: int, checks: int) -> None:
    """The end of a checking script's main: shut the distributed runtime down, then report
    how many checks this process passed (the wrapper compares it with its least)."""
    dist.shutdown()
    report(me, f"OK {me} {n} {checks}")


def run(main, reference) -> None:
    """A checking script's entry point: ``--reference OUT`` runs ``reference(OUT)`` (the
    one-process values the processes compare with), anything else ``main(arg)``."""
    if sys.argv[1] == "--reference":
        reference(sys.argv[2])
    else:
        main(sys.argv[1])
