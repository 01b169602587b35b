//! The browser voice chat that `duplex serve` serves at `/`: the files of `web/`, embedded in
//! the binary (plain modules, no build step, nothing fetched at run time). What the page does is
//! its own business (`web/app.js`); this only hands out the files with their types.

use axum::http::header;
use axum::routing::get;

const FILES: &[(&str, &str, &str)] = &[
    (
        "/",
        "text/html; charset=utf-8",
        include_str!("../../../web/index.html"),
    ),
    (
        "/app.js",
        "text/javascript; charset=utf-8",
        include_str!("../../../web/app.js"),
    ),
    (
        "/ogg.js",
        "text/javascript; charset=utf-8",
        include_str!("../../../web/ogg.js"),
    ),
    (
        "/worklets.js",
        "text/javascript; charset=utf-8",
        include_str!("../../../web/worklets.js"),
    ),
    (
        "/style.css",
        "text/css; charset=utf-8",
        include_str!("../../../web/style.css"),
    ),
];

/// The page's routes.
pub(super) fn routes<S: Clone + Send + Sync + 'static>() -> axum::Router<S> {
    let mut r = axum::Router::new();
    for &(path, ctype, body) in FILES {
        r = r.route(
            path,
            get(move || async move {
                (
                    [
                        (header::CONTENT_TYPE, ctype),
                        (header::CACHE_CONTROL, "no-cache"),
                    ],
                    body,
                )
            }),
        );
    }
    r
}
