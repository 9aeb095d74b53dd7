// Drives llama.cpp's web UI in headless Chromium: opens the page at URL, sends each
// message as a chat turn, and records what the browser sent and received.
//
//   node scripts/web_ui_chat.mjs URL OUT_DIR "first message" "second message" ...
//
// UI_SETTINGS (JSON) sets the UI's settings as a user would have saved them, e.g.
// '{"max_tokens": 12}'. Writes OUT_DIR/turns.json ([{request, status, headers, body, answer_text}] per turn)
// and OUT_DIR/chat.png (a screenshot after the last turn). Needs playwright-core
// (NODE_PATH, see scripts/web_ui_setup.sh) and CHROMIUM (default /usr/bin/chromium).
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

// ES modules ignore NODE_PATH: resolve playwright-core from the folder it names
const require = createRequire(join(process.env.NODE_PATH ?? process.cwd(), 'noop.js'));
const { chromium } = require('playwright-core');

const [url, outDir, ...messages] = process.argv.slice(2);
if (!url || !outDir || messages.length === 0) {
	console.error('usage: web_ui_chat.mjs URL OUT_DIR MESSAGE...');
	process.exit(2);
}
mkdirSync(outDir, { recursive: true });
const TURN_TIMEOUT_MS = Number(process.env.TURN_TIMEOUT_MS ?? 120000);

// a fresh profile each run: no settings or conversations left from before
const browser = await chromium.launchPersistentContext(
	mkdtempSync(join(tmpdir(), 'web-ui-chromium-')),
	{
		executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
		headless: true,
		viewport: { width: 1280, height: 900 },
		args: [
			'--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
			'--disable-background-networking', '--disable-component-update', '--disable-sync'
		]
	}
);
const turns = [];
try {
	const page = await browser.newPage();
	// DevTools hands back a text/event-stream body decoded as windows-1252; read what
	// the page itself reads instead, decoded as UTF-8 (a clone of each chat response)
	await page.addInitScript(() => {
		const fetch = window.fetch.bind(window);
		window.__chatBodies = [];
		window.fetch = async (...args) => {
			const response = await fetch(...args);
			const url = String(args[0] instanceof Request ? args[0].url : args[0]);
			if (url.includes('/chat/completions')) {
				const slot = window.__chatBodies.push(null) - 1;
				response.clone().text().then((text) => (window.__chatBodies[slot] = text));
			}
			return response;
		};
	});
	if (process.env.UI_SETTINGS) {
		// the UI keeps its settings in localStorage (constants/storage.constants.ts)
		const settings = JSON.parse(process.env.UI_SETTINGS);
		await page.addInitScript((s) => {
			localStorage.setItem('LlamaUi.config', JSON.stringify(s));
			localStorage.setItem('LlamaUi.userOverrides', JSON.stringify(Object.keys(s)));
		}, settings);
	}
	page.on('console', (msg) => {
		if (msg.type() === 'error') console.error(`[page] ${msg.text()}`);
	});
	await page.goto(url, { waitUntil: 'load' });
	const input = page.locator('textarea').first();
	await input.waitFor({ state: 'visible', timeout: 60000 });

	for (const message of messages) {
		const answered = page.waitForResponse(
			(r) => r.url().includes('/chat/completions') && r.request().method() === 'POST',
			{ timeout: TURN_TIMEOUT_MS }
		);
		await input.fill(message);
		await input.press('Enter');
		const response = await answered;
		await response.finished();
		const turn = turns.length;
		await page.waitForFunction((i) => typeof window.__chatBodies[i] === 'string', turn);
		const body = await page.evaluate((i) => window.__chatBodies[i], turn);
		// let the page render the final chunk
		await page.waitForTimeout(1500);
		const answers = page.locator('[aria-label="Assistant message with actions"]');
		const count = await answers.count();
		const answerText = count > 0 ? await answers.nth(count - 1).innerText() : '';
		turns.push({
			request: JSON.parse(response.request().postData() ?? 'null'),
			status: response.status(),
			headers: await response.allHeaders(),
			body,
			answer_text: answerText
		});
		console.log(`turn ${turns.length}: ${response.status()} ${(await response.allHeaders())['x-npu-spec']}`);
	}
	await page.screenshot({ path: join(outDir, 'chat.png'), fullPage: true });
} finally {
	writeFileSync(join(outDir, 'turns.json'), JSON.stringify(turns, null, 1));
	await browser.close();
}
