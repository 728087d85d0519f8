"""A live web dashboard over a broker's status: ``libra dashboard --broker URL`` (its own process, a read-only
client of the broker, like ``libra status``).

Modules: ``timeline`` (role switches and re-plans from the audit trail and the planner's decisions, de-duplicated
across polls; pure), ``history`` (the series, bucket occupancy and job curves derived from the polls; pure),
``poller`` (the broker client's poll loop), ``guard`` (the loopback-or-token rule and the token check), ``app``
(the Starlette routes: ``/``, ``/api/status``, ``/api/events``), ``__main__`` (the command) and ``static/`` (the
page: plain HTML, a script, and uPlot vendored with its licence in ``static/NOTICE``; no build step).
"""
