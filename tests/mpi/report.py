"""The result line of a script run under mpirun: printed, and where CT_TEST_OUT names a folder,
also added to that folder's file of this process (mpirun's forwarding of the processes'
output may merge their lines), which the pytest wrappers read."""
import os


def report(me: int, line: str) -> None:
    print(line, flush=True)
    if os.environ.get("CT_TEST_OUT"):
        with open(os.path.join(os.environ["CT_TEST_OUT"], str(me)), "a") as f:
            f.write(line + "\n")
