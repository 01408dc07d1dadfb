"""Generated notes (docs/notes/): one page per host, a fleet index, plots, and the git commit, in four steps.

1. `gather`: the store and the inventory into one view per host (`views.HostView`), every host string
   made plain and redacted.
2. `sections`: views into page views (`pages`) and the charts each section shows (`plots`); `points`
   picks the stored points, `fmt` prints them, `summary` writes each host's one-line headline.
3. `render`: page views laid out by the jinja2 templates in templates/, charts drawn beside the page.
4. `publish`: pages written behind the leak check, and the notes commit of docs/ and hosts/.

Everything on a page is a function of artifacts/ and the inventory alone: no clock, no environment,
fixed number formats and sorted orders, so the same inputs give the same bytes and git only sees a
change when a figure changed. Rendering never projects: a host with no measured run shows the
projection the flows stored for it, and the backtest figures are the stored backtest's. Every string
that came from a host is made plain and redacted when the views are gathered and escaped with `md`
when the page views are built, so the templates never escape and one odd host cannot break a table,
inject markup or block the fleet's notes.
"""
