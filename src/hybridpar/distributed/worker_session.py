"""The first module the launcher's forkserver imports (:data:`hybridpar.distributed.launch.PRELOAD`):
importing it moves the importing process into a session of its own.

Why: ``hybridpar train --nproc N`` forks its workers from a forkserver that has torch and the
trainer imported, so a restart does not import them again. The workers are that server's
children and die with it (:func:`hybridpar.distributed.lifecycle.die_with_parent`). In the
launcher's session, a terminal's SIGHUP or a SIGTERM sent to the launcher's process group would
kill the server at once, and with it every worker, before the launcher forwarded the signal for
their preemption checkpoint. In a session of its own, as the workers of a spawned launcher are,
only the launcher hears the terminal. Nothing else imports this module (the launcher names it
as a string), so no other process is moved.
"""

from __future__ import annotations

import contextlib
import os

with contextlib.suppress(OSError):  # already a session's leader: nothing to move
    os.setsid()
