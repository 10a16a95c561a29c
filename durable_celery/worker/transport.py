"""The embedded default broker: kombu's filesystem transport with atomic message files.

kombu's own transport creates a message file and then writes it, so a consumer polling the
folder can take the file while it is still empty and fail to decode it. Here a message is
written under a name no consumer looks at and renamed into place, which is atomic.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

SCHEME = "durablefs"


class Channel(filesystem.Channel):
    """A filesystem channel whose messages appear whole or not at all."""

    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{int(round(filesystem.monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`."""

    Channel = Channel


TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
