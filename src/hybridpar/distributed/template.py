"""The first module the launcher's forkserver imports (:data:`hybridpar.distributed.launch.PRELOAD`),
setting up the process every worker of the job is forked from. Nothing else imports it (the
launcher names it as a string), so importing it changes only that server.

* A session of its own. The workers are the server's children and die with it
  (:func:`hybridpar.distributed.lifecycle.die_with_parent`). In the launcher's session, a
  terminal's SIGHUP or a SIGTERM sent to the launcher's process group would kill the server at
  once, and with it every worker, before the launcher forwarded the signal for their preemption
  checkpoint. In a session of its own, as a spawning launcher's workers are, only the launcher
  hears the terminal.
* It dies with the launcher (its parent), so its workers die with it (``die_with_parent``
  ties each worker to this server). Without that, the server would outlive a SIGKILLed
  launcher: multiprocessing gives every forked child the write end of the pipe whose closing
  tells the server to stop, so the workers keep the server alive and it keeps them.
* No warning for re-running the launcher's main module. A forked child re-runs the parent's
  ``__main__`` module under the name ``__mp_main__`` (multiprocessing's preparation for
  pickled functions); for ``python -m hybridpar.cli`` that module is already imported here,
  and runpy warns about it in every worker of every restart. Re-running it defines functions
  and nothing else (its ``entry()`` is guarded by ``__name__``).
"""

from __future__ import annotations

import contextlib
import os
import warnings

from hybridpar.distributed.lifecycle import die_with_parent

with contextlib.suppress(OSError):  # already a session's leader: nothing to move
    os.setsid()
die_with_parent()
warnings.filterwarnings("ignore", message=r"'hybridpar\.", category=RuntimeWarning, module="runpy")
