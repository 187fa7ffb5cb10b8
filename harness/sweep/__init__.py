"""Stress as a map: a sweep file turned into one Deploy per grid point (``grid``), latency and
duration per request (``metrics``), the gate over a map (``gate``), and the map's tables, heatmaps
and page (``report``)."""
