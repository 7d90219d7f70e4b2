"""The web dashboard's routes: server-rendered pages (templates in web/templates), signed in with a
user token kept in an http-only, same-site cookie; every form carries a CSRF token."""
