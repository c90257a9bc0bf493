// Clientside helpers: keep the address bar equal to the view's state without a page reload
// (replaceState fires no Dash navigation event, so the page is not rebuilt).
window.dash_clientside = Object.assign({}, window.dash_clientside, {
    decodescope: {
        replaceUrl: function (href) {
            if (href && window.location.pathname + window.location.search !== href) {
                window.history.replaceState(null, "", href);
            }
            return href;
        }
    }
});
