"""Example remote: a fake weather service (README.md#serve-and-call-a-remote).

With ``DISPATCH_URL`` (the instance's base URL, ``http://127.0.0.1:8000``) and
``DISPATCH_TOKEN`` in the environment and the ``dispatch-remote`` package installed:
``dispatch-remote serve examples/weather_service.py:remote`` (``--server URL --token T``
work too), or ``python examples/weather_service.py``; then ``dispatch-remote call
weather-service get_forecast '{"city": "Rome"}'``. In a clone of the server, from its
root, without installing anything: ``python -m remotes.client serve
examples/weather_service.py:remote``. This file is not in the wheel: copy it, or write
your own (README, "Serve and call a remote").
"""

from __future__ import annotations

import zlib

try:
    from dispatch_remote import Remote
except ModuleNotFoundError:  # a clone of the server, where the client is `remotes.client`
    from remotes.client import Remote

# No url or token here: they come from the command line (serve --server/--token) or the
# environment (DISPATCH_URL, DISPATCH_TOKEN) when it starts serving.
remote = Remote("weather-service")


@remote.function
def get_forecast(city: str) -> dict[str, str | int]:
    """Retrieve weather forecast for a location.

    Args:
        city: Name of the city, e.g. "Rome".

    Returns:
        ``{"city", "forecast", "temperature_c"}``; the same city always gets the same
        (fake) forecast.
    """
    temperature_c = zlib.crc32(city.encode()) % 35 - 5
    return {"city": city, "forecast": "sunny", "temperature_c": temperature_c}


if __name__ == "__main__":
    remote.run()
