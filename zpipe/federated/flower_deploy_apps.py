"""The Flower App components of Eco-FL on the deployment engine (imports Flower).

A Flower App's ``pyproject.toml`` names its ``ServerApp`` and ``ClientApp``
as ``module:attribute``, and Flower checks the attribute by reading the
module's source, so they are built here at import;
:mod:`zpipe.federated.flower_deploy` says what they do and imports no Flower.
"""

from __future__ import annotations

from zpipe.federated.flower_deploy import make_client_app, make_server_app

server_app = make_server_app()
client_app = make_client_app()
