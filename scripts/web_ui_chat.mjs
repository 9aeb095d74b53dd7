// Drives llama.cpp's web UI in headless Chromium: opens the page at URL, sends each
// message as a chat turn, and records what the browser sent and received.
//
//   node scripts/web_ui_chat.mjs URL OUT_DIR "first message" "second message" ...
//
// Writes OUT_DIR/turns.json ([{request, status, headers, body, answer_text}] per turn)
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
		const body = await response.text(); // the whole stream, once it has ended
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
